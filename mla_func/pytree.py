"""Frozen dataclasses as optree pytrees, under mla-func's own registry namespace.

A field declared with `static_field()` is metadata (part of the tree structure,
compared on unflatten); every other field is a child (a tensor, None, or a
nested pytree). Use `tree_map` / `tree_flatten` from here so the namespace is
never forgotten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import optree

NAMESPACE = "mla_func"
T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is tree metadata rather than a child."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def register_dataclass(cls: type[T]) -> type[T]:
    """Register an already-decorated dataclass with optree (children = non-static fields).

    Fields with `init=False` are neither: the constructor makes them afresh on unflatten.
    """
    fields = [f for f in dataclasses.fields(cls) if f.init]
    children = tuple(f.name for f in fields if not f.metadata.get("static"))
    statics = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return (
            tuple(getattr(obj, n) for n in children),
            tuple(getattr(obj, n) for n in statics),
            children,
        )

    def unflatten(meta: tuple[Any, ...], values: tuple[Any, ...]) -> Any:
        return cls(**dict(zip(children, values)), **dict(zip(statics, meta)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)
    return cls


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(spec: Any, leaves: list[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)
