"""The model's state: per-layer caches of typed kinds, paged in cache groups, as one pytree.

Each layer owns one cache value of its kind (see `layer_cache`); the state holds
them in layer order, the static geometry of each cache group, and the scratch
buffers kernels are handed. Block 0 of every group is the scratch block: the
allocator never hands it out; padded rows, and a table's blocks that were freed
behind a group's lookback, point at it. It holds garbage, so every read of it is
masked out with a select (`where`), never by arithmetic on what it holds.

Everything that moves a state moves its pytree leaves: cloning, copying into a
graph's buffers, checking buffers against a captured graph, making a fresh handle.
A layer kind with more leaves needs no change here.

Functions that write the state return a new one. Fast paths write the same
buffers in place, so the state they were given is *donated*: it is marked, and
using it again raises `DonatedStateError` (the old handle would silently see the
new contents otherwise). `copy=True` on those functions writes out of place and
leaves the old state valid, for code that wants to branch or differentiate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mla_func.kernels.index_cache import zeroed_index_cache
from mla_func.kernels.latent_cache import zeroed_latent
from mla_func.pytree import register_dataclass, static_field, tree_leaves

from .block_allocator import SCRATCH_BLOCK
from .layer_cache import CacheGroup, DSALayerCache, LayerCache, MLALayerCache

__all__ = ["SCRATCH_BLOCK", "CacheGroup", "DSALayerCache", "DonatedStateError", "KVCacheState", "MLALayerCache"]


class DonatedStateError(RuntimeError):
    """A state that was donated to an earlier call was used again."""


class _Liveness:
    """The one mutable part of a state: who it was donated to, if anyone."""

    __slots__ = ("donated_to",)

    def __init__(self) -> None:
        self.donated_to: str | None = None


@register_dataclass
@dataclass(frozen=True, slots=True, eq=False)
class KVCacheState:
    """Per-layer caches, the cache groups they live in, and scratch buffers.

    layers:  one cache per layer, of that layer's kind (e.g. `MLALayerCache`)
    scratch: buffers kernels are handed (static shapes), part of the pytree
    groups:  the geometry of each cache group (static), each with its own block count;
             every tensor a layer pages by group g (`LayerCache.paged_in(g)`) is
             [groups[g].num_blocks, groups[g].block_size, ...]

    Flattening and unflattening (e.g. `tree_map`) makes a new, live value: liveness
    belongs to a handle, not to the buffers.
    """

    layers: tuple[Any, ...]
    groups: tuple[CacheGroup, ...] = static_field()
    scratch: tuple[torch.Tensor, ...] = ()
    _liveness: _Liveness = static_field(default_factory=_Liveness, init=False, repr=False, compare=False)

    @classmethod
    def checked(
        cls,
        layer_caches: Sequence[Any],
        *,
        groups: Sequence[CacheGroup],
        scratch: Sequence[torch.Tensor] = (),
    ) -> KVCacheState:
        """A state of the given layer caches (one a layer, in layer order), checked against the
        geometry of `groups` (`check_geometry`): how a state is made from fresh caches."""
        state = cls(layers=tuple(layer_caches), groups=tuple(groups), scratch=tuple(scratch))
        state.check_geometry()
        return state

    def check_geometry(self) -> None:
        """Raise ValueError unless every layer's paged tensors match its group's geometry.

        Run where a state is made (`checked`), not on every step: handles made by
        tree operations keep the leaves they were made from.
        """
        if not self.layers:
            raise ValueError("KVCacheState.layers: expected at least one layer cache, got none")
        if not self.groups:
            raise ValueError("KVCacheState.groups: expected at least one cache group, got none")
        if self.groups[0].tokens_per_entry != 1:
            # Every real row writes one group-0 slot: that is how a batch tells real rows from padding.
            raise ValueError(f"KVCacheState.groups[0].tokens_per_entry: group 0 holds one entry per token, got "
                             f"{self.groups[0].tokens_per_entry}")
        for i, layer in enumerate(self.layers):
            cache: LayerCache = layer
            if not 0 <= cache.group < len(self.groups):
                raise ValueError(f"layers[{i}].group: expected in [0, {len(self.groups)}), got {cache.group}")
            for index, g in enumerate(self.groups):
                for t in cache.paged_in(index):
                    if tuple(t.shape[:2]) != (g.num_blocks, g.block_size):
                        raise ValueError(
                            f"layers[{i}]: a paged tensor of group {index} must start with "
                            f"(num_blocks, block_size) = {(g.num_blocks, g.block_size)}, got {tuple(t.shape)}"
                        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        """Blocks of cache group 0 (scratch included)."""
        return self.groups[0].num_blocks

    @property
    def block_size(self) -> int:
        """Entries a block of cache group 0 holds (tokens, as group 0 has one entry per token)."""
        return self.groups[0].block_size

    @property
    def device(self) -> torch.device:
        """The device of the first layer's first paged tensor (as `dtype`: no pytree walk, read every step)."""
        return self.layers[0].paged()[0].device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first layer's first paged tensor: the activations' dtype the state was made
        for (an FP8 latent cache lists its RoPE values first, `LayerCache.paged`)."""
        return self.layers[0].paged()[0].dtype

    def leaves(self) -> list[torch.Tensor]:
        """Every tensor of the state, in pytree order."""
        return tree_leaves(self)

    def bytes_per_block(self, group: int = 0) -> int:
        """Bytes one block of `group` takes over all layers (what a block costs the memory budget): every
        leaf a layer pages by that group's tables, whichever group the layer itself is in."""
        cache: LayerCache
        return sum(t[0].numel() * t.element_size() for cache in self.layers for t in cache.paged_in(group))

    @property
    def is_donated(self) -> bool:
        return self._liveness.donated_to is not None

    def check_live(self, user: str) -> None:
        """Raise DonatedStateError if this state was donated; `user` names the caller."""
        if self._liveness.donated_to is not None:
            raise DonatedStateError(
                f"{user}: this state was donated to {self._liveness.donated_to}, which updated its cache in "
                "place; use the state that call returned (or pass copy=True to keep this one valid)"
            )

    def donate(self, to: str) -> None:
        """Mark this state as consumed by `to`; later use raises."""
        self.check_live(to)
        self._liveness.donated_to = to

    def renewed(self) -> KVCacheState:
        """A new live handle over the same buffers: every field (so every leaf) kept, liveness fresh."""
        return replace(self)


def zeroed_mla_caches(
    num_layers: int,
    kv_lora_rank: int,
    rope_dim: int,
    group: CacheGroup,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str = "auto",
) -> tuple[MLALayerCache, ...]:
    """One zeroed [num_blocks, block_size, kv_lora_rank + rope_dim] latent cache per layer, in group 0,
    in `kv_cache_dtype` (`kernels.latent_cache.zeroed_latent`: "auto" is `dtype`)."""
    return tuple(
        MLALayerCache(kv=zeroed_latent(group.num_blocks, group.block_size, kv_lora_rank, rope_dim,
                                       kv_cache_dtype=kv_cache_dtype, dtype=dtype, device=device))
        for _ in range(num_layers)
    )


def zeroed_dsa_cache(
    kv_lora_rank: int,
    rope_dim: int,
    index_head_dim: int,
    group: CacheGroup,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str = "auto",
) -> DSALayerCache:
    """One sparse-attention layer's zeroed caches in group 0: latents [num_blocks, block_size,
    kv_lora_rank + rope_dim] and indexer keys [num_blocks, block_size, index_head_dim], both in
    `kv_cache_dtype` (`zeroed_latent`, `zeroed_index_cache`: "auto" is `dtype`, "fp8" FP8 values
    with scales)."""
    shape = (group.num_blocks, group.block_size)
    return DSALayerCache(kv=zeroed_latent(*shape, kv_lora_rank, rope_dim, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                                          device=device),
                         index_k=zeroed_index_cache(*shape, index_head_dim, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                                                    device=device))
