"""The rule-based answer checker of text tasks (`math`, `arithmetic`): the last `\\boxed{...}`,
else the last number, of a reply against the reference answer."""

from __future__ import annotations

import re
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")


def extract_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), else the last number in
    `text` (`-12`, `1,234.5`, `3/4`), else None."""
    last = None
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for j in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                last = text[start:j]
                break
    if last is not None:
        return last.strip()
    numbers_found = _NUMBER.findall(text)
    return numbers_found[-1] if numbers_found else None


def normalize_answer(answer: Any) -> str:
    """A canonical string: no spaces, `$`, `\\left`/`\\right`, `\\!`, trailing `.`;
    `\\dfrac{a}{b}`/`\\frac{a}{b}` -> `a/b`; thousands separators dropped from numbers."""
    s = str(answer).strip()
    for junk in ("$", "\\left", "\\right", "\\!", "\\,", " "):
        s = s.replace(junk, "")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return re.sub(r"\((-?[\d.]+)\)", r"\1", s)


def _as_number(s: str) -> float | None:
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:/(-?\d+(?:\.\d+)?))?", s)
    if m is None:
        return None
    num, den = float(m.group(1)), (float(m.group(2)) if m.group(2) else 1.0)
    return None if den == 0 else num / den


def answers_match(predicted: Any, reference: Any) -> bool:
    """Equal after `normalize_answer`, or equal as numbers (fractions allowed) to 1e-6 relative."""
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y))


def math_reward(response_text: str, answer: Any, **meta: Any) -> float:
    """1.0 if the response's answer (`extract_answer`) matches `answer`, else 0.0."""
    predicted = extract_answer(response_text)
    return float(predicted is not None and answers_match(predicted, answer))

