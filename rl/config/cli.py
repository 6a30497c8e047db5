"""The command line: conf/ composed by Hydra onto the schema (`compose`), loaded as the typed
`Config` (`load`: keys left unset, keys the schema lacks), and train.py's check of its own
command line before Hydra makes a run folder (`check_command_line`). Each error names the key,
the closest valid keys or what the key expects."""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, List

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf, open_dict

from rl.choice import Choice, did_you_mean
from rl.config.checks import validate
from rl.config.schema import Config


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
    if not OmegaConf.has_resolver("required"):
        OmegaConf.register_new_resolver("required", _required)


# A config group marks a key the user must set with `${required:}`, not `???`: Hydra merges
# the group onto the schema, and OmegaConf keeps the schema's default (None) when merging
# '???' onto it, so a `???` would silently become None (a random model, no prompts file).
# `${required:${other.key}}` defaults to another key's value and is required when that is null
# (conf/task/math.yaml: task.tokenizer_path is the model's folder, unless a random model has none).
REQUIRED = "${required:}"


def _required(default: Any = None, *, _node_: Any) -> Any:
    if default is not None:
        return default
    # OmegaConf has no public accessor for the full key of a resolver's node (`_node_`)
    raise ValueError(f"{_node_._get_full_key(None)}: required but not set (pass it on the command line)")


CONF = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: list[str] | tuple[str, ...] = (), *, hydra_node: bool = False) -> Any:
    """conf/config.yaml with Hydra `overrides`, as train.py's Hydra composes it (no run folder,
    nothing resolved): the untyped DictConfig `load` takes (with the `hydra` node when
    `hydra_node`). A key that does not exist is a ValueError naming it, the closest valid keys
    (difflib) and the keys of its section; a value of the wrong type, or outside a closed
    choice, names the key and what it expects."""
    dict_cfg, error = _hydra_compose(overrides, hydra_node)
    if error is None:
        return dict_cfg
    cause = _omegaconf_cause(error)
    if cause is None:  # an unknown config group option (Hydra lists the options) or a malformed override
        raise ValueError(str(error).split("\nConfig search path:")[0]) from None
    key = cause.full_key
    if "not in" in str(cause):  # an unknown key: ConfigKeyError / ConfigAttributeError
        others = [o for o in overrides if not _within(_override_key(o), key) and not _within(_override_key(o), "hydra")]
        base, failed = _hydra_compose(others, False)
        raise ValueError(_unknown_key(key, base if failed is None else _hydra_compose((), False)[0])) from None
    given = [o.split("=", 1)[1] for o in overrides if "=" in o and _override_key(o) == key]
    value = given[-1] if given else getattr(cause, "value", None)  # a list item's own value: trainer.loggers[1]
    choice = _schema_type(re.sub(r"\[\d+\]", "", key))  # trainer.loggers[1]: an item of List[Logger]
    choice = typing.get_args(choice)[0] if typing.get_origin(choice) in (list, List) else choice
    expected = (f"expected one of {', '.join(choice.values())}" if isinstance(choice, type) and issubclass(choice, Choice)
                else str(cause).splitlines()[0])
    raise ValueError(f"{key}={'?' if value is None else value}: {expected}") from None


def check_command_line(argv: list[str]) -> tuple[Config, str | None] | None:
    """train.py's command line, checked before Hydra makes a run folder and before the heavy
    imports (a config error in seconds): composed, loaded and validated as the run will be.
    Returns the typed config and `hydra.run.dir` as written (unresolved; None for a sweep,
    -m, which is checked at the first value of each swept key); None for a command line with
    other Hydra flags (--help, --cfg, ...: Hydra's own business)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    first = []
    for text, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if parsed.is_sweep_override():
            try:
                text = f"{text.split('=', 1)[0]}={next(iter(parsed.sweep_string_iterator()))}"
            except Exception:  # an interval sweep (for an optimizing sweeper): no first value to check
                return None
        first.append(text)
    dict_cfg = compose(first, hydra_node=True)
    run_dir = OmegaConf.to_container(dict_cfg.hydra.run, resolve=False)["dir"]
    with open_dict(dict_cfg):
        del dict_cfg["hydra"]
    cfg = validate(load(dict_cfg), world_size=int(os.environ.get("WORLD_SIZE", "1"))).cfg  # as the run uses it
    return cfg, None if len(overrides) < len(argv) else run_dir


def _hydra_compose(overrides: Any, hydra_node: bool) -> tuple[Any, Exception | None]:
    """Hydra's compose API on conf/: (config, None) or (None, the error)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            return hydra_compose("config", overrides=list(overrides), return_hydra_config=hydra_node), None
        except (HydraException, OmegaConfBaseException) as e:
            return None, e


def _within(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _omegaconf_cause(e: BaseException | None) -> Any:
    """The OmegaConf error behind a Hydra composition error (it carries the full key), or None."""
    while e is not None:
        if getattr(e, "full_key", None):
            return e
        e = e.__cause__
    return None


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _unknown_key(key: str, base: Any) -> str:
    """The message for a `key` the config `base` does not have (or should not): the closest
    valid keys, the keys of its section, and for a free-form dict (`model.overrides`,
    `task.options`) how to add one."""
    keys = [k for k, _ in _entries(base) if not _within(key, k) and not _within(k, key)]
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(base, parent) if parent else base
    message = f"{key}: no such key" + (did_you_mean(key, keys, n=3, cutoff=0.75) or ".")
    if node is not None and OmegaConf.is_dict(node):
        siblings = sorted(str(k) for k in node.keys() if str(k) != name)
        message += f" The keys of {parent or 'the config'}: {', '.join(siblings) or '(none yet)'}."
        if OmegaConf.get_type(node) is dict:  # a free-form dict of the schema: new keys are allowed
            message += f" {parent} takes keys of your own: add one with +{key}=..."
    return message


def _entries(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value as written) of every entry of the config `node`, each section before its
    keys: OmegaConf.to_container, nothing resolved (a missing value is '???', an interpolation its text)."""
    raw = OmegaConf.to_container(node, resolve=False) if not isinstance(node, dict) else node
    out = []
    for key, value in raw.items():
        out.append((f"{prefix}{key}", value))
        if isinstance(value, dict):
            out += _entries(value, f"{prefix}{key}.")
    return out


def _extra_keys(node: Any) -> list[str]:
    """Keys of `node` that their schema dataclass does not have (`+trainer.max_step=1` composes:
    Hydra adds the key, and the typed config would silently drop it); a free-form dict's keys
    (`model.overrides`) and the keys under an extra one are not looked at."""
    out = []
    for key, _ in _entries(node):
        parent, _, name = key.rpartition(".")
        cls = _schema_type(parent) if parent else Config
        if dataclasses.is_dataclass(cls) and name not in {f.name for f in dataclasses.fields(cls)}:
            out.append(key)
    return out


def _schema_type(key: str) -> Any:
    """The schema's type of the dotted `key` (Optional unwrapped), or None when it has none."""
    cls: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hint = typing.get_type_hints(cls).get(part)
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        cls = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    return cls


def load(dict_cfg: Any) -> Config:
    """The Hydra config as a typed `Config`; a key left unset (`${required:}` from the chosen
    config group, or '???' where the schema has no default) is an error naming every such key."""
    missing = _unset_required(dict_cfg) or sorted(OmegaConf.missing_keys(dict_cfg))  # (the latter resolves)
    if missing:
        raise ValueError(f"{', '.join(missing)}: required but not set (the chosen config group needs it); "
                         f"pass {missing[0]}=...")
    extra = _extra_keys(dict_cfg)
    if extra:
        raise ValueError(_unknown_key(extra[0], dict_cfg))
    return OmegaConf.to_object(dict_cfg)


def _unset_required(root: Any) -> list[str]:
    """Dotted keys still holding `REQUIRED`, or a `${required:${other.key}}` whose other key is null."""
    return [key for key, value in _entries(root) if value == REQUIRED or (
        isinstance(value, str) and value.startswith(REQUIRED[:-1])
        and OmegaConf.select(root, key, throw_on_resolution_failure=False) is None)]
