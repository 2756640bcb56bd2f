"""The paged latent KV cache as an explicit, immutable-by-contract value.

Each layer caches one `kv_lora_rank + qk_rope_head_dim` vector per token (the
normalised latent c_kv, then the rotated k_pe), in blocks of `block_size` tokens.
Block 0 is the scratch block: the allocator never hands it out, padded rows of a
batch point at it, and nothing reads what lands there.

Functions that write the cache return a new state. Fast paths write the same
buffers in place, so the state they were given is *donated*: it is marked, and
using it again raises `DonatedStateError` (the old handle would silently see the
new contents otherwise). `copy=True` on those functions writes out of place and
leaves the old state valid, for code that wants to branch or differentiate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mla_func.pytree import register_dataclass

SCRATCH_BLOCK = 0


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
    """Per-layer paged latent caches.

    kv_cache: one [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] tensor per layer.

    Flattening and unflattening (e.g. `tree_map`) makes a new, live value: liveness
    belongs to a handle, not to the buffers.
    """

    kv_cache: tuple[torch.Tensor, ...]
    _liveness: _Liveness = field(default_factory=_Liveness, init=False, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.kv_cache)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.kv_cache[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.kv_cache[0].device

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

    def with_caches(self, kv_cache: tuple[torch.Tensor, ...]) -> KVCacheState:
        """A new live state holding `kv_cache`."""
        return KVCacheState(kv_cache=tuple(kv_cache))


def init_state(
    num_layers: int,
    kv_cache_dim: int,
    *,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCacheState:
    """A zeroed cache of `num_blocks` blocks (block 0 is scratch) of `block_size` tokens per layer."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks: need at least 2 (block 0 is scratch), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    return KVCacheState(
        kv_cache=tuple(
            torch.zeros(num_blocks, block_size, kv_cache_dim, dtype=dtype, device=device) for _ in range(num_layers)
        )
    )
