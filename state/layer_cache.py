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

A group's `lookback` says how far back a later step still reads it: the tokens
before the next position of a sequence (the first it has not computed) whose
entries a future query can read. None means every token, for the whole
sequence (MLA's latents). A group with a lookback holds a sequence's blocks only
while they can still be read: the scheduler frees the ones wholly before
`num_computed - lookback` and keeps the table positional by putting the scratch
block where they were (`first_live_block`, `state.cache_groups`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from mla_func.kernels.index_cache import IndexCache, index_leaves
from mla_func.kernels.latent_cache import LatentCache, latent_leaves
from mla_func.pytree import register_dataclass, static_field


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """The geometry of one cache group.

    num_blocks:       blocks of the group, block 0 (scratch) included
    block_size:       entries a block holds
    tokens_per_entry: tokens that make one entry (1: one entry per token)
    lookback:         tokens before a sequence's next position that a later step can still read
                      here (None: every token of the sequence; see the module docstring)
    """

    num_blocks: int
    block_size: int
    tokens_per_entry: int = 1
    lookback: int | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"CacheGroup.num_blocks: need at least 2 (block 0 is scratch), got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"CacheGroup.block_size: must be positive, got {self.block_size}")
        if self.tokens_per_entry < 1:
            raise ValueError(f"CacheGroup.tokens_per_entry: must be positive, got {self.tokens_per_entry}")
        if self.lookback is not None and self.lookback < 0:
            raise ValueError(f"CacheGroup.lookback: must be None or >= 0, got {self.lookback}")
        if self.lookback is not None and self.tokens_per_entry != 1:
            # The block arithmetic of a bounded group (`peak_blocks`, `blocks_in_flight`) counts tokens as entries.
            raise ValueError(f"CacheGroup.lookback: only a group of one entry per token has one, got lookback "
                             f"{self.lookback} with tokens_per_entry {self.tokens_per_entry}")

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.tokens_per_entry

    def entries(self, num_tokens: int) -> int:
        """Complete entries of a sequence of `num_tokens` tokens (an entry is written by its last token)."""
        return num_tokens // self.tokens_per_entry

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold the entries of a sequence of `num_tokens` tokens."""
        return -(-self.entries(num_tokens) // self.block_size)

    def first_live_block(self, num_tokens: int) -> int:
        """Blocks of a sequence of `num_tokens` computed tokens that no later step reads: those wholly
        before position num_tokens - lookback (0 without a lookback). They can be freed."""
        if self.lookback is None:
            return 0
        return max(0, num_tokens - self.lookback) // self.tokens_per_block

    def live_blocks(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` computed tokens holds once those behind its lookback are freed."""
        return self.blocks_for(num_tokens) - self.first_live_block(num_tokens)

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence holds at once on its way to `num_tokens` tokens: max of `live_blocks(t)`
        over t <= num_tokens, which is not monotone with a lookback (a block is added before one is freed).

        With lookback L and tokens per block b, live_blocks(t) = ceil((r + L) / b) for t > L, where
        r = (t - L) mod b, so the most up to T is blocks_for(min(T, L + b - 1)).
        """
        if self.lookback is None:
            return self.blocks_for(num_tokens)
        return self.blocks_for(min(num_tokens, self.lookback + self.tokens_per_block - 1))

    def blocks_in_flight(self, max_num_seqs: int, max_step_tokens: int) -> int:
        """Blocks (scratch included) that always hold max_num_seqs sequences during a step feeding at most
        max_step_tokens tokens, for a group with a lookback.

        A sequence at n tokens that feeds q more holds the blocks of positions [n - L, n + q): at most
        ceil(L / b) + ceil(q / b) + 1 of them (b tokens a block); over the sequences the q sum to at most
        max_step_tokens, so S * (ceil(L / b) + 2) + ceil(max_step_tokens / b) blocks are enough.
        """
        if self.lookback is None:
            raise ValueError("CacheGroup.blocks_in_flight: a group without a lookback holds whole sequences")
        b = self.tokens_per_block
        return 1 + max_num_seqs * (-(-self.lookback // b) + 2) + -(-max_step_tokens // b)

    def max_tokens(self, num_blocks: int) -> int:
        """The longest sequence whose entries `num_blocks` blocks hold (the inverse of `blocks_for`): its
        tokens past the last entry complete none, so they need no block. Positional: what a table of
        that many entries covers now, placeholders of freed blocks included."""
        return (num_blocks * self.block_size + 1) * self.tokens_per_entry - 1

    def longest_sequence(self, num_blocks: int) -> int:
        """The longest a sequence can grow with `num_blocks` blocks of this group: `max_tokens`, but with a
        lookback the blocks behind it are freed as it grows, so once `num_blocks` hold the blocks of a
        one-token step at any length (those of positions [n - lookback, n + 1)) no length is too long,
        and this is `sys.maxsize`."""
        if self.lookback is not None and num_blocks >= self.blocks_for(self.lookback + self.tokens_per_block):
            return sys.maxsize
        return self.max_tokens(num_blocks)

    def sized_for(self, num_tokens: int) -> CacheGroup:
        """This group with the blocks (scratch included) that hold the entries of `num_tokens` tokens."""
        return replace(self, num_blocks=max(2, 1 + self.blocks_for(num_tokens)))


class LayerCache(Protocol):
    """What every per-layer cache kind provides: its group and its paged tensors."""

    @property
    def group(self) -> int: ...

    def paged(self) -> tuple[torch.Tensor, ...]:
        """The tensors indexed [num_blocks, block_size, ...] by the group's block tables, the first of
        them in the activations' dtype (what `KVCacheState.dtype` reads)."""
        ...

    def paged_in(self, group: int) -> tuple[torch.Tensor, ...]:
        """The tensors indexed [num_blocks, block_size, ...] by cache group `group`'s block tables
        (a kind may keep leaves in several groups); () for a group it has none in."""
        ...


@register_dataclass
@dataclass(frozen=True, slots=True)
class MLALayerCache:
    """One MLA layer's paged latent cache.

    kv: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (normalised c_kv, then rotated k_pe),
        a tensor in the activations' dtype or an `FP8LatentCache` of that shape (`kernels.latent_cache`)
    """

    kv: LatentCache
    group: int = static_field(default=0)

    def paged(self) -> tuple[torch.Tensor, ...]:
        return latent_leaves(self.kv)

    def paged_in(self, group: int) -> tuple[torch.Tensor, ...]:
        return self.paged() if group == self.group else ()


@register_dataclass
@dataclass(frozen=True, slots=True)
class DSALayerCache:
    """One DeepSeek Sparse Attention layer's paged caches: MLA's latents and the indexer's keys.

    Both hold one vector per token in the same group, so one block table and one slot
    mapping address both, and prefix caching, chunking and preemption move them together.

    kv:      [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (as `MLALayerCache`, a tensor
             or an `FP8LatentCache`)
    index_k: [num_blocks, block_size, index_head_dim] the indexer's keys (LayerNorm, then
             the first qk_rope_head_dim dims rotated half-split): a tensor in the activations' dtype
             beside a tensor latent cache, an `FP8IndexCache` (`kernels.index_cache`) beside an FP8 one
    """

    kv: LatentCache
    index_k: IndexCache
    group: int = static_field(default=0)

    def paged(self) -> tuple[torch.Tensor, ...]:
        return (*latent_leaves(self.kv), *index_leaves(self.index_k))

    def paged_in(self, group: int) -> tuple[torch.Tensor, ...]:
        return self.paged() if group == self.group else ()
