"""Frozen dataclasses as optree pytrees, under mla-func's own registry namespace.

Classes are decorated with the standard `dataclasses.dataclass(frozen=True,
slots=True)`, then registered here. A field declared with `static_field()` is
metadata (part of the tree structure, compared on unflatten); every other field
is a child (a tensor, None, or a nested pytree). Static fields carry optree's own
marker (`metadata["pytree_node"] = False`, as `optree.dataclasses.field` sets it).

The registration is written here rather than `optree.dataclasses.register_node`
because that function needs optree 0.19.1, while this one runs on every optree
from 0.13 (the floor torch's own pytree support accepts, and what older CUDA
images carry); both make the same children, the same metadata, and rebuild
`init=False` fields through the constructor. Once optree >= 0.19.1 can be
required, `register_dataclass` becomes `optree.dataclasses.register_node(cls,
namespace=NAMESPACE)` with no other change. Use `tree_map` / `tree_flatten` from here so the namespace is
never forgotten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, cast

import optree

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
    fields = [f for f in dataclasses.fields(cast(Any, cls)) if f.init]
    children = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    statics = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in children), tuple(getattr(obj, n) for n in statics), children

    def unflatten(meta: tuple[Any, ...], values: tuple[Any, ...]) -> Any:
        return cls(**dict(zip(children, values)), **dict(zip(statics, meta)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]
    return cls


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(spec: Any, leaves: list[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)
