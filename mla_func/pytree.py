"""Frozen dataclasses as optree pytrees, under mla-func's own registry namespace.

Registration is `optree.dataclasses.register_node` (optree >= 0.19.1) on classes
decorated with the standard `dataclasses.dataclass(frozen=True, slots=True)`. A
field declared with `static_field()` is metadata (part of the tree structure,
compared on unflatten); every other field is a child (a tensor, None, or a
nested pytree). Use `tree_map` / `tree_flatten` from here so the namespace is
never forgotten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import optree.dataclasses

NAMESPACE = "mla_func"
T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is tree metadata rather than a child."""
    return dataclasses.field(metadata={"pytree_node": False}, **kwargs)


def register_dataclass(cls: type[T]) -> type[T]:
    """Register an already-decorated dataclass with optree (children = the fields not marked static).

    A field with `init=False` must be a `static_field(init=False, ...)`: it is neither child nor
    metadata, and the constructor makes it afresh on unflatten.
    """
    optree.dataclasses.register_node(cls, namespace=NAMESPACE)
    return cls


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(spec: Any, leaves: list[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)
