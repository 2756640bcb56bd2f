"""Cache bytes a sequence holds, and the contexts that fit a given memory: the numbers to plan with.

A model's paged cache lives in cache groups (`state.layer_cache.CacheGroup`): group 0 holds one entry
per token, a compressed group one entry per `tokens_per_entry` tokens. A sequence of T tokens holds
`group.blocks_for(T)` blocks of each group (as the scheduler allocates them), and a block of group g
costs `bytes_per_block[g]` bytes over every layer's leaves of that group. So

    sequence_bytes(T) = sum over g of blocks_for_g(T) * bytes_per_block[g]

Every figure here is that arithmetic on a `CacheBudget`; `cache_budget(config, ...)` makes one from a
model config by measuring a two-block state on the meta device (no memory), so it follows whatever the
family's layer kinds cache. Units: bytes (int), tokens (int); "bytes a token" at T is
sequence_bytes(T) / T, which is not constant where some groups are compressed (their blocks cover
more tokens) or where partly filled blocks round up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.layers import cache_groups
from mla_func.core.prepare import init_state
from mla_func.pytree import tree_leaves
from mla_func.state.layer_cache import CacheGroup

__all__ = ["CacheBudget", "CacheReport", "cache_budget", "entry_bytes"]


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
                        group is scratch), the scarcest group deciding
    sequences:          sequences of `context` tokens the usable blocks hold at once
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
            # Only group 0 grows with every token; without it no byte count bounds a context.
            raise ValueError("CacheBudget.bytes_per_block[0]: group 0 must cost bytes, got 0")

    def blocks(self, context: int) -> tuple[int, ...]:
        """Blocks of each group a sequence of `context` tokens holds (the scheduler's `blocks_for`)."""
        _check_count("context", context, 0)
        return tuple(g.blocks_for(context) for g in self.groups)

    def sequence_bytes(self, context: int) -> int:
        """Bytes one sequence of `context` tokens holds, every group's blocks together."""
        return sum(n * b for n, b in zip(self.blocks(context), self.bytes_per_block))

    def bytes_per_token(self, context: int) -> float:
        """sequence_bytes(context) / context: what a token costs on average at that context."""
        _check_count("context", context, 1)
        return self.sequence_bytes(context) / context

    def longest_context(self, budget_bytes: int) -> int:
        """The most tokens one sequence can have in `budget_bytes` bytes of blocks, every group sized to
        what it needs (0 when not even one token fits): sequence_bytes(L) <= budget_bytes <
        sequence_bytes(L + 1)."""
        _check_count("budget_bytes", budget_bytes, 0)
        if self.sequence_bytes(1) > budget_bytes:
            return 0
        # sequence_bytes never falls as tokens are added, and group 0 takes a block every block_size
        # tokens, so budget_bytes / bytes_per_block[0] blocks of it bound the answer from above.
        low, high = 1, (budget_bytes // self.bytes_per_block[0] + 1) * self.groups[0].block_size
        while low < high:  # invariant: low fits, high + 1 does not
            mid = (low + high + 1) // 2
            if self.sequence_bytes(mid) <= budget_bytes:
                low = mid
            else:
                high = mid - 1
        return low

    def sequences_that_fit(self, context: int, budget_bytes: int) -> int:
        """How many sequences of `context` tokens `budget_bytes` bytes of blocks hold at once."""
        _check_count("budget_bytes", budget_bytes, 0)
        need = self.sequence_bytes(_check_count("context", context, 1))
        return budget_bytes // need

    # ---- the blocks a state has (every group's own count, block 0 scratch) ----------------------

    @property
    def total_bytes(self) -> int:
        """Bytes of every block of every group, scratch blocks included: what the state allocates."""
        return sum(g.num_blocks * b for g, b in zip(self.groups, self.bytes_per_block))

    def longest_context_in_blocks(self) -> int:
        """The most tokens one sequence can cover with every usable block of every group (the scarcest
        group decides; as `GroupedAllocator.num_usable_tokens` with nothing allocated)."""
        return min(g.max_tokens(g.num_blocks - 1) for g in self.groups)

    def sequences_in_blocks(self, context: int) -> int:
        """Sequences of `context` tokens every group's usable blocks hold at once."""
        need = self.blocks(_check_count("context", context, 1))
        # Group 0 takes a block from the first token; a group a sequence takes none of does not limit it.
        return min((g.num_blocks - 1) // n for g, n in zip(self.groups, need) if n)

    def report(self, context: int) -> CacheReport:
        """The figures at `context` tokens, over this budget's blocks (see `CacheReport`)."""
        return CacheReport(context=context, sequence_bytes=self.sequence_bytes(context),
                           bytes_per_token=self.bytes_per_token(context), blocks=self.blocks(context),
                           longest_context=self.longest_context_in_blocks(),
                           sequences=self.sequences_in_blocks(context), total_bytes=self.total_bytes)


def entry_bytes(config: ModelConfig, dtype: torch.dtype) -> tuple[int, ...]:
    """Bytes one entry of each cache group takes over every layer, in `dtype` (one int a group).

    Measured on a two-block state on the meta device whose block size is the least common multiple of
    the groups' tokens per entry: every group's block then covers that many tokens, so its block size
    (entries a block) tells a leaf's group apart, and groups with one block size have one geometry.
    """
    rates = [g.tokens_per_entry for g in cache_groups(config, CacheGroup(num_blocks=2, block_size=1))]
    tokens = math.lcm(*rates)
    probe = init_state(config, num_blocks=2, block_size=tokens, dtype=dtype, device="meta")
    group_of = {g.block_size: i for i, g in enumerate(probe.groups)}
    per_entry = [0] * len(probe.groups)
    for i, layer in enumerate(probe.layers):
        for leaf in tree_leaves(layer):
            group = group_of.get(leaf.shape[1]) if leaf.dim() >= 2 and leaf.shape[0] == 2 else None
            if group is None:
                raise ValueError(f"layers[{i}]: a cache leaf of shape {tuple(leaf.shape)} is paged by no cache "
                                 f"group of {probe.groups} (expected [2, block_size, ...])")
            per_entry[group] += leaf[0, 0].numel() * leaf.element_size()
    return tuple(per_entry)


def cache_budget(config: ModelConfig, *, dtype: torch.dtype, block_size: int = 16,
                 num_blocks: int = 2) -> CacheBudget:
    """The `CacheBudget` of `init_state(config, num_blocks=num_blocks, block_size=block_size, dtype=dtype)`,
    without allocating it: its groups and each group's bytes a block (entries a block x bytes an entry)."""
    _check_count("block_size", block_size, 1)
    _check_count("num_blocks", num_blocks, 2)
    groups = cache_groups(config, CacheGroup(num_blocks=num_blocks, block_size=block_size))
    return CacheBudget(groups=groups,
                       bytes_per_block=tuple(g.block_size * e for g, e in zip(groups, entry_bytes(config, dtype))))
