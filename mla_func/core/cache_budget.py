"""Cache bytes a sequence holds, and the contexts that fit a given memory: the numbers to plan with.

A model's paged cache lives in cache groups (`state.layer_cache.CacheGroup`): group 0 holds one entry
per token, a compressed group one entry per `tokens_per_entry` tokens. A block of group g costs
`bytes_per_block[g]` bytes over every layer's leaves of that group. A sequence of T tokens holds
`group.live_blocks(T)` blocks of each group once its step is done, as the scheduler keeps them: every
block of [0, T) for a group without a lookback, only those of its last `lookback` tokens for a group
with one (the others are freed, `GroupedAllocator.free_behind`). So

    sequence_bytes(T) = sum over g of live_blocks_g(T) * bytes_per_block[g]

A bounded group's live blocks do not grow with T (they step up by one block and back as T crosses
block boundaries), so where group 0 is bounded the bytes a token fall with the context toward those
of the groups that keep every entry. What a sequence needs on its way to T tokens is the most it held
at any length up to T, `peak_bytes(T)`; the longest context and the sequences that fit a memory count
that (and a pool of blocks, each group's own peak: `CacheGroup.peak_blocks`).

Every figure here is that arithmetic on a `CacheBudget`; `cache_budget(config, ...)` makes one from a
model config by measuring a two-block state on the meta device (no memory), so it follows whatever the
family's layer kinds cache. Units: bytes (int), tokens (int); "bytes a token" at T is
sequence_bytes(T) / T, which is not constant where some groups are compressed (their blocks cover
more tokens) or bounded, or where partly filled blocks round up.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.layers import cache_groups
from mla_func.core.prepare import init_state
from mla_func.state.layer_cache import CacheGroup

__all__ = ["CacheBudget", "CacheReport", "cache_budget", "entry_bytes", "most_blocks_within"]


def _check_count(name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class CacheReport:
    """A cache's figures at one context (what `Engine.cache_report` and `mla-func bench` print).

    context:            tokens of the sequence the figures are for
    sequence_bytes:     bytes one sequence of `context` tokens holds, every group's blocks together
    bytes_per_token:    sequence_bytes / context
    blocks:             blocks of each group one such sequence holds
    longest_context:    the most tokens one sequence can cover with every usable block (block 0 of each
                        group is scratch), the scarcest group deciding (`sys.maxsize`: no group limits it)
    sequences:          sequences growing to `context` tokens the usable blocks hold at once
    total_bytes:        bytes of every block of every group (scratch included)
    """

    context: int
    sequence_bytes: int
    bytes_per_token: float
    blocks: tuple[int, ...]
    longest_context: int
    sequences: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class CacheBudget:
    """A paged cache's geometry and its cost: the groups and the bytes one block of each takes.

    groups:          the cache groups (group 0: one entry per token), as `KVCacheState.groups`
    bytes_per_block: bytes one block of each group takes over every layer, one int a group
    """

    groups: tuple[CacheGroup, ...]
    bytes_per_block: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("CacheBudget.groups: expected at least one cache group, got none")
        if len(self.bytes_per_block) != len(self.groups):
            raise ValueError(f"CacheBudget.bytes_per_block: expected one per group ({len(self.groups)}), "
                             f"got {self.bytes_per_block}")
        for g, b in enumerate(self.bytes_per_block):
            _check_count(f"CacheBudget.bytes_per_block[{g}]", b, 0)
        if self.bytes_per_block[0] == 0:
            # Every sequence holds group 0's blocks; without their cost no byte count bounds a context.
            raise ValueError("CacheBudget.bytes_per_block[0]: group 0 must cost bytes, got 0")

    def blocks(self, context: int) -> tuple[int, ...]:
        """Blocks of each group a sequence of `context` tokens holds once its step is done (the scheduler's
        tables less the blocks freed behind a group's lookback: `CacheGroup.live_blocks`)."""
        _check_count("context", context, 0)
        return tuple(g.live_blocks(context) for g in self.groups)

    def sequence_bytes(self, context: int) -> int:
        """Bytes one sequence of `context` tokens holds, every group's blocks together."""
        return sum(n * b for n, b in zip(self.blocks(context), self.bytes_per_block))

    def peak_bytes(self, context: int) -> int:
        """The most bytes one sequence holds at any length up to `context` tokens: what growing to that
        context takes. Never falls as the context grows.

        Past its lookback and a block, a bounded group's live blocks repeat with a period of its tokens a
        block while the other groups' only grow, so the lengths before the last period add nothing new
        beyond the first `settle` ones."""
        _check_count("context", context, 0)
        bounded = [g for g in self.groups if g.lookback is not None]
        if not bounded:
            return self.sequence_bytes(context)
        period = math.lcm(*(g.tokens_per_block for g in bounded))
        settle = max((g.lookback or 0) + g.tokens_per_block for g in bounded)
        lengths = range(context + 1) if context <= settle + period else (
            *range(settle + 1), *range(context - period + 1, context + 1))
        return max(self.sequence_bytes(t) for t in lengths)

    def bytes_per_token(self, context: int) -> float:
        """sequence_bytes(context) / context: what a token costs on average at that context."""
        _check_count("context", context, 1)
        return self.sequence_bytes(context) / context

    def longest_context(self, budget_bytes: int) -> int:
        """The most tokens one sequence can grow to in `budget_bytes` bytes of blocks, every group sized to
        what it needs (0 when not even one token fits): peak_bytes(L) <= budget_bytes < peak_bytes(L + 1).
        `sys.maxsize` when no group's blocks grow with the context and they fit."""
        _check_count("budget_bytes", budget_bytes, 0)
        if self.peak_bytes(1) > budget_bytes:
            return 0
        # A group that keeps every entry takes a block every tokens_per_block tokens, so the budget's worth of
        # its blocks bounds the answer from above; bounded groups stop growing past lookback + a block.
        growing = [(budget_bytes // b + 1) * g.tokens_per_block
                   for g, b in zip(self.groups, self.bytes_per_block) if g.lookback is None and b]
        if growing:
            high = min(growing)
        else:
            high = max((g.lookback or 0) + g.tokens_per_block for g in self.groups)
            if self.peak_bytes(high) <= budget_bytes:
                return sys.maxsize
        return _largest(1, high, lambda n: self.peak_bytes(n) <= budget_bytes)

    def sequences_that_fit(self, context: int, budget_bytes: int) -> int:
        """How many sequences growing to `context` tokens `budget_bytes` bytes of blocks hold at once."""
        _check_count("budget_bytes", budget_bytes, 0)
        need = self.peak_bytes(_check_count("context", context, 1))
        return budget_bytes // need

    # ---- the blocks a state has (every group's own count, block 0 scratch) ----------------------

    @property
    def total_bytes(self) -> int:
        """Bytes of every block of every group, scratch blocks included: what the state allocates."""
        return sum(g.num_blocks * b for g, b in zip(self.groups, self.bytes_per_block))

    def longest_context_in_blocks(self) -> int:
        """The most tokens one sequence can cover with every usable block of every group (the scarcest
        group decides; as `GroupedAllocator.num_usable_tokens` with nothing allocated; `sys.maxsize`
        where no group limits it)."""
        return min(g.longest_sequence(g.num_blocks - 1) for g in self.groups)

    def sequences_in_blocks(self, context: int) -> int:
        """Sequences growing to `context` tokens every group's usable blocks hold at once."""
        _check_count("context", context, 1)
        need = [g.peak_blocks(context) for g in self.groups]
        # Group 0 takes a block from the first token; a group a sequence takes none of does not limit it.
        return min((g.num_blocks - 1) // n for g, n in zip(self.groups, need) if n)

    def report(self, context: int) -> CacheReport:
        """The figures at `context` tokens, over this budget's blocks (see `CacheReport`)."""
        return CacheReport(context=context, sequence_bytes=self.sequence_bytes(context),
                           bytes_per_token=self.bytes_per_token(context), blocks=self.blocks(context),
                           longest_context=self.longest_context_in_blocks(),
                           sequences=self.sequences_in_blocks(context), total_bytes=self.total_bytes)


def entry_bytes(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> tuple[int, ...]:
    """Bytes one entry of each cache group takes over every layer, in `dtype` and `kv_cache_dtype`
    (`init_state`'s), one int a group.

    Measured on a state of blocks of one entry on the meta device: each group's bytes a block
    (`KVCacheState.bytes_per_block`, every leaf a layer pages by that group).
    """
    probe = init_state(config, num_blocks=2, block_size=1, dtype=dtype, device="meta", kv_cache_dtype=kv_cache_dtype)
    per_entry = tuple(probe.bytes_per_block(g) // group.block_size for g, group in enumerate(probe.groups))
    paged = sum(e * g.block_size * g.num_blocks for e, g in zip(per_entry, probe.groups))
    allocated = sum(t.numel() * t.element_size() for t in probe.leaves())
    if paged != allocated:
        raise ValueError(f"entry_bytes: the state's leaves take {allocated} bytes, its groups' blocks {paged}: "
                         "a cache leaf is paged by no cache group (LayerCache.paged_in)")
    return per_entry


def cache_budget(config: ModelConfig, *, dtype: torch.dtype, block_size: int = 16, num_blocks: int = 2,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 kv_cache_dtype: str = "auto") -> CacheBudget:
    """The `CacheBudget` of `init_state(config, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
    max_num_seqs=..., max_num_batched_tokens=..., kv_cache_dtype=...)`, without allocating it: its groups
    (`layers.cache_groups`) and each group's bytes a block (entries a block x bytes an entry)."""
    _check_count("block_size", block_size, 1)
    _check_count("num_blocks", num_blocks, 2)
    groups = cache_groups(config, CacheGroup(num_blocks=num_blocks, block_size=block_size),
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    per_entry = entry_bytes(config, dtype, kv_cache_dtype)
    return CacheBudget(groups=groups, bytes_per_block=tuple(g.block_size * e for g, e in zip(groups, per_entry)))


def most_blocks_within(config: ModelConfig, *, dtype: torch.dtype, block_size: int, budget_bytes: int, most: int,
                       max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                       group0_extra_bytes: int = 0, kv_cache_dtype: str = "auto") -> int:
    """The largest num_blocks in [2, most] whose state (`init_state` with these arguments) takes at most
    `budget_bytes`, counting `group0_extra_bytes` more for each block of group 0 (a cache kept in its
    geometry beside the state, such as a drafter's); 2 when none does.

    Each group's blocks follow num_blocks (`layers.cache_groups`), so the state's bytes never fall as
    it grows, and a bisection finds it (bytes an entry measured once).
    """
    _check_count("most", most, 2)
    per_entry = entry_bytes(config, dtype, kv_cache_dtype)

    def state_bytes(num_blocks: int) -> int:
        groups = cache_groups(config, CacheGroup(num_blocks=num_blocks, block_size=block_size),
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        return (sum(g.num_blocks * g.block_size * e for g, e in zip(groups, per_entry))
                + groups[0].num_blocks * group0_extra_bytes)

    return _largest(2, most, lambda n: state_bytes(n) <= budget_bytes)


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [low, high] for which `fits(n)`, a predicate true up to some n and false after it;
    `low` when none is."""
    while low < high:  # invariant: low fits, high + 1 does not
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
