"""Per-layer cache kinds and the cache groups their paged tensors belong to.

A layer's cache is a frozen pytree of one kind (`MLALayerCache` for DeepSeek-V2/V3's
latent cache); a new layer kind brings its own dataclass with the leaves it needs.
Every kind names the cache group of its paged tensors and lists them in `paged()`:
each is indexed [num_blocks, block_size, ...] by the group's block tables.

A cache group is one paged address space: its own blocks, block tables, slot
mapping and allocator. `tokens_per_entry` is how many tokens make one entry (1 for
a per-token cache such as MLA's latents; r for a cache that holds one compressed
entry per r tokens), so a block of a group covers `block_size * tokens_per_entry`
tokens. Group 0 is the group every model has; DeepSeek-V2/V3 have only it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mla_func.pytree import register_dataclass, static_field


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """The geometry of one cache group.

    num_blocks:       blocks of the group, block 0 (scratch) included
    block_size:       entries a block holds
    tokens_per_entry: tokens that make one entry (1: one entry per token)
    """

    num_blocks: int
    block_size: int
    tokens_per_entry: int = 1

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"CacheGroup.num_blocks: need at least 2 (block 0 is scratch), got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"CacheGroup.block_size: must be positive, got {self.block_size}")
        if self.tokens_per_entry < 1:
            raise ValueError(f"CacheGroup.tokens_per_entry: must be positive, got {self.tokens_per_entry}")

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.tokens_per_entry

    def entries(self, num_tokens: int) -> int:
        """Complete entries of a sequence of `num_tokens` tokens (an entry is written by its last token)."""
        return num_tokens // self.tokens_per_entry

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold the entries of a sequence of `num_tokens` tokens."""
        return -(-self.entries(num_tokens) // self.block_size)

    def max_tokens(self, num_blocks: int) -> int:
        """The longest sequence whose entries `num_blocks` blocks hold (the inverse of `blocks_for`):
        its tokens past the last entry complete none, so they need no block."""
        return (num_blocks * self.block_size + 1) * self.tokens_per_entry - 1


class LayerCache(Protocol):
    """What every per-layer cache kind provides: its group and its paged tensors."""

    @property
    def group(self) -> int: ...

    def paged(self) -> tuple[torch.Tensor, ...]:
        """The tensors indexed [num_blocks, block_size, ...] by the group's block tables."""
        ...


@register_dataclass
@dataclass(frozen=True, slots=True)
class MLALayerCache:
    """One MLA layer's paged latent cache.

    kv: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (normalised c_kv, then rotated k_pe)
    """

    kv: torch.Tensor
    group: int = static_field(default=0)

    def paged(self) -> tuple[torch.Tensor, ...]:
        return (self.kv,)


@register_dataclass
@dataclass(frozen=True, slots=True)
class DSALayerCache:
    """One DeepSeek Sparse Attention layer's paged caches: MLA's latents and the indexer's keys.

    Both hold one vector per token in the same group, so one block table and one slot
    mapping address both, and prefix caching, chunking and preemption move them together.

    kv:      [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (as `MLALayerCache`)
    index_k: [num_blocks, block_size, index_head_dim] the indexer's keys (LayerNorm, then
             the first qk_rope_head_dim dims rotated half-split)
    """

    kv: torch.Tensor
    index_k: torch.Tensor
    group: int = static_field(default=0)

    def paged(self) -> tuple[torch.Tensor, ...]:
        return (self.kv, self.index_k)
