"""`Choice`: the base of every closed config choice (policy loss, aggregation, estimator ...).

A `Choice` is a `str`-valued `Enum`, so a member compares equal to its string value and a
function can take either: `LossAgg("token-mean") is LossAgg.TOKEN_MEAN`, `LossAgg(LossAgg.TOKEN_MEAN)`
too. Each enum lives in the module that owns its concept; this module only gives them
the shared behaviour:

* an unknown value raises a `ValueError` listing the values (`Choice.parse(value, key)`
  names the config key as well);
* lookup by *value* through `Enum[...]`, which is how OmegaConf converts a YAML string
  into an Enum-typed structured-config field: `loss_agg: token-mean` works although the
  member is named `TOKEN_MEAN` (OmegaConf's own check rejects anything else, naming the
  full key).
"""

from __future__ import annotations

import difflib
from enum import Enum, EnumMeta
from typing import Any, Iterable, TypeVar

C = TypeVar("C", bound="Choice")


class _ChoiceMeta(EnumMeta):
    def __getitem__(cls, name: str):  # noqa: D105 - by member name, then by value
        try:
            return super().__getitem__(name)
        except KeyError:
            try:
                return cls(name)
            except ValueError:
                raise KeyError(name) from None


class Choice(str, Enum, metaclass=_ChoiceMeta):
    """A closed set of string choices (see the module docstring)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]

    @classmethod
    def _missing_(cls, value: Any):
        if isinstance(value, str):  # case-insensitive: "PPO" -> ppo
            for member in cls:
                if member.value == value.lower():
                    return member
        raise ValueError(f"{value!r} is not a {cls.__name__}; expected one of {', '.join(cls.values())}")

    @classmethod
    def parse(cls: type[C], value: Any, key: str) -> C:
        """`value` (a member or its string) as a member; else a ValueError naming `key`."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected one of {', '.join(cls.values())}"
                             f"{did_you_mean(value, cls.values())}") from None


def did_you_mean(name: str, names: Iterable[str], n: int = 1, cutoff: float = 0.6) -> str:
    """"; did you mean X?" for the names closest to a misspelt `name` (difflib), or "" when none is close."""
    close = difflib.get_close_matches(str(name), [str(x) for x in names], n=n, cutoff=cutoff)
    return f"; did you mean {' or '.join(close)}?" if close else ""


class Registry(dict):
    """An open choice: names registered by decorators (advantage estimators, policy losses).

    `add` refuses a name taken; `lookup` raises a ValueError naming the config key, the value,
    the registered names and where to register one."""

    def __init__(self, what: str, key: str, where: str) -> None:
        super().__init__()
        self.what, self.key, self.where = what, key, where

    def add(self, name: str, value: Any) -> None:
        if name in self:
            raise ValueError(f"{self.what} {name!r} is already registered ({self[name]})")
        self[name] = value

    def lookup(self, name: Any, key: str | None = None) -> Any:
        value = self.get(str(name))
        if value is None:
            raise ValueError(f"{key or self.key}={name!r}: not a registered {self.what}; registered: "
                             f"{sorted(self)} ({self.where})")
        return value

    def copy(self) -> "Registry":
        out = Registry(self.what, self.key, self.where)
        out.update(self)
        return out
