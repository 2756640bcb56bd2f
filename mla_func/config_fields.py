"""Checks of single config.json fields, each error naming the field and the value found."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A config.json field has a value mla-func does not support (the message names the field)."""


def refuse(field_name: str, value: Any, why: str) -> ConfigError:
    """The error for one field: its config.json name, the value found and what was expected."""
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return ConfigError(f"config field {field_name!r} = {shown}: {why}")


def is_int(value: Any) -> bool:
    """A JSON integer: `true` is a bool in JSON, never a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not is_int(value) or value < low:
        kind = "null or an integer" if optional else "an integer"
        raise refuse(name, value, f"must be {kind} >= {low}")


def check_positive(name: str, value: Any, *, optional: bool = False, above: float = 0.0) -> None:
    """A finite number > `above` (None allowed when optional)."""
    if optional and value is None:
        return
    if not is_number(value) or not math.isfinite(value) or value <= above:
        raise refuse(name, value, f"must be a finite number > {above:g}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise refuse(name, value, "must be true or false")
