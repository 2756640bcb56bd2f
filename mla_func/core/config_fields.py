"""Checks of single config.json fields, each error naming the field and the value found."""

from __future__ import annotations

import math
from typing import Any, TypeGuard


class ConfigError(ValueError):
    """A config.json field has a value mla-func does not support (the message names the field)."""


def refuse(field_name: str, value: Any, why: str, *, index: int | None = None) -> ConfigError:
    """The error for one field: its config.json name, the value found and what was expected.

    index: the entry of a list-valued field that is at fault (`value` is then that entry).
    """
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    entry = "" if index is None else f"[{index}]"
    return ConfigError(f"config field {field_name!r}{entry} = {shown}: {why}")


def is_int(value: Any) -> TypeGuard[int]:
    """A JSON integer: `true` is a bool in JSON, never a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_float(value: Any) -> Any:
    """A JSON number as a float; anything else unchanged, for validation to name.

    JSON integers have no bound: one past float's range becomes an infinity of its sign,
    which validation refuses by the field's name (float() itself would raise OverflowError).
    """
    if not is_number(value):
        return value
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_int(name: str, value: Any, low: int, high: int | None = None, *, optional: bool = False,
              why: str = "") -> None:
    """An integer in [low, high] (no upper bound when `high` is None; None allowed when optional).

    why: what the upper bound is, said after it in the error (e.g. "n_routed_experts").
    """
    if optional and value is None:
        return
    if not is_int(value) or value < low or (high is not None and value > high):
        kind = "null or an integer" if optional else "an integer"
        bound = f">= {low}" if high is None else f"in [{low}, {f'{why}=' if why else ''}{high}]"
        raise refuse(name, value, f"must be {kind} {bound}")


def at_most(value: Any, limit: Any) -> Any:
    """min(value, limit) when both are integers; anything else unchanged, for validation to name."""
    return min(value, limit) if is_int(value) and is_int(limit) else value


def check_choice(name: str, value: Any, allowed: tuple[str, ...], *, index: int | None = None) -> None:
    """`value` (entry `index` of a list field) is one of the strings `allowed`; any other value, a list or
    an object included, is refused."""
    if not isinstance(value, str) or value not in allowed:
        raise refuse(name, value, f"expected one of {allowed}", index=index)


def check_entries(name: str, values: Any, allowed: tuple[str, ...], count: int) -> None:
    """A list of num_hidden_layers=`count` entries, each one of `allowed`; an error names the entry's index."""
    if not isinstance(values, (list, tuple)) or len(values) != count:
        shown = list(values) if isinstance(values, tuple) else values
        raise refuse(name, shown, f"must list num_hidden_layers={count} entries, each one of {allowed}")
    for i, value in enumerate(values):
        check_choice(name, value, allowed, index=i)


def check_positive(name: str, value: Any, *, optional: bool = False, above: float = 0.0) -> None:
    """A finite number > `above` (None allowed when optional)."""
    if optional and value is None:
        return
    if not is_number(value) or not math.isfinite(as_float(value)) or value <= above:
        raise refuse(name, value, f"must be a finite number > {above:g}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise refuse(name, value, "must be true or false")
