"""Block accounting for several cache groups (host side, plain Python).

A sequence holds one block table per cache group (see `layer_cache.CacheGroup`):
group g's blocks hold `block_size` entries of `tokens_per_entry` tokens each, so
covering n tokens takes `blocks_for(n)` of its blocks. `GroupedAllocator` keeps one
`BlockAllocator` per group and does every operation on all groups at once, all
or nothing: a step either gets the blocks of every group it needs or none.
DeepSeek-V2/V3 have exactly one group of one entry per token.

Tables are positional: entry i covers tokens [i * tokens_per_block, (i + 1) *
tokens_per_block). A group with a `lookback` holds only the blocks a later step can
read: once a step's results are in, `free_behind` frees the blocks wholly before
num_computed - lookback and puts `SCRATCH_BLOCK` where they were, so a table of a
bounded group is a run of scratch placeholders, then the live blocks. Everything
that frees, truncates or counts tables skips the placeholders.

Prefix caching across groups. A block's key is the chained content hash of the
tokens it covers (`hash_block`), so a cached block stands for its whole token
prefix, and any state that is a pure function of the tokens of its blocks is
covered by the key. State that is not stored in full blocks (a compressor's
carry of the tokens since its last complete entry, a partial entry) is not: a
prefix hit is therefore cut to a length at which every such piece is empty and
every group's blocks are full, a multiple of `prefix_alignment`: the least
common multiple of every group's tokens per block and of the `carry_period`s the
layer kinds declare (the caller passes them). A hit of length P needs, of a group
without a lookback, its blocks of [0, P); of a group with one, only those of
[P - lookback, P), which are all a later step reads there. Their hashes come from
the tokens (a hash chain needs no lookup), and only those tail blocks are looked
up. Where some tail block is no longer cached (it was evicted after its sequence
freed it), the hit is cut back by the alignment until the tail is there; what lies
past the hit is recomputed. Recomputing the missing tail instead is not an option:
a window's keys at one layer depend on the layer below's output over its own
window, so exact keys of the tail need the tokens before it all the way down to
the first layer, that is, the whole prefix again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .block_allocator import SCRATCH_BLOCK, BlockAllocator, BlockHash, OutOfBlocks, hash_block, hash_chain
from .layer_cache import CacheGroup

Tables = tuple[list[int], ...]


class GroupedAllocator:
    """One `BlockAllocator` per cache group, used as one."""

    def __init__(self, groups: Sequence[CacheGroup], *, enable_prefix_caching: bool = True,
                 carry_periods: Sequence[int] = ()):
        if not groups:
            raise ValueError("groups: expected at least one cache group, got none")
        if groups[0].tokens_per_entry != 1:
            raise ValueError(f"groups[0].tokens_per_entry: group 0 holds one entry per token, got "
                             f"{groups[0].tokens_per_entry}")
        self.groups = tuple(groups)
        self.enable_prefix_caching = enable_prefix_caching
        # Each allocator counts tokens per block, the unit its content hashes cover.
        self.allocators = tuple(BlockAllocator(g.num_blocks, g.tokens_per_block,
                                               enable_prefix_caching=enable_prefix_caching) for g in groups)
        self.prefix_alignment = math.lcm(*(g.tokens_per_block for g in groups), *carry_periods)
        # The groups whose blocks behind a lookback are freed as sequences grow (none for V2/V3).
        self._bounded = tuple(i for i, g in enumerate(groups) if g.lookback is not None)
        # Group 0 holds one entry per token, so it covers n tokens with ceil(n / block_size) blocks; a
        # model with no other group (V2/V3) takes that shortcut in `blocks_needed`, which the scheduler
        # calls for every decoding request every step.
        self._only_block_size = groups[0].block_size if len(groups) == 1 else None
        self._tokens_per_block = tuple(g.tokens_per_block for g in groups)

    @property
    def has_lookback(self) -> bool:
        """Whether some group frees blocks behind a lookback (`free_behind` does nothing otherwise)."""
        return bool(self._bounded)

    def empty_tables(self) -> Tables:
        return tuple([] for _ in self.groups)

    def blocks_needed(self, tables: Tables, num_tokens: int) -> tuple[int, ...]:
        """Blocks each group must add to `tables` to cover `num_tokens` tokens (tables are positional:
        placeholders of freed blocks count as covered)."""
        if (block_size := self._only_block_size) is not None:
            return (max(0, -(-num_tokens // block_size) - len(tables[0])),)
        return tuple(max(0, g.blocks_for(num_tokens) - len(t)) for g, t in zip(self.groups, tables))

    def can_allocate(self, needs: Sequence[int]) -> bool:
        return all(n <= a.num_free_blocks for n, a in zip(needs, self.allocators))

    def allocate(self, tables: Tables, needs: Sequence[int]) -> None:
        """Append `needs[g]` fresh blocks to each group's table; all groups or none."""
        if not self.can_allocate(needs):
            free = [a.num_free_blocks for a in self.allocators]
            raise OutOfBlocks(f"asked for {list(needs)} blocks per cache group, only {free} are available")
        for table, n, allocator in zip(tables, needs, self.allocators):
            table += allocator.allocate(n)

    def free(self, tables: Tables) -> None:
        """Drop one reference to every block of every group's table (placeholders hold none)."""
        for table, allocator in zip(tables, self.allocators):
            allocator.free([b for b in table if b != SCRATCH_BLOCK])

    def truncate(self, tables: Tables, num_tokens: int) -> None:
        """Free the blocks past those covering `num_tokens` tokens, in every group."""
        for g, table, allocator in zip(self.groups, tables, self.allocators):
            keep = g.blocks_for(num_tokens)
            allocator.free([b for b in table[keep:] if b != SCRATCH_BLOCK])
            del table[keep:]

    def free_behind(self, tables: Tables, num_computed: int) -> None:
        """In each group with a lookback, free the blocks no later step reads -- those wholly before
        num_computed - lookback (`CacheGroup.first_live_block`) -- and put `SCRATCH_BLOCK` in their place.

        Call it once a step's results are in (after a verify row's truncation): `num_computed` is what
        the sequence keeps. Freed blocks that are registered in the prefix cache become evictable.
        """
        for index in self._bounded:
            table = tables[index]
            end = self.groups[index].first_live_block(num_computed)
            # The placeholders are a prefix of the table, so the blocks to free are the run before `end`.
            start = end
            while start > 0 and table[start - 1] != SCRATCH_BLOCK:
                start -= 1
            if start < end:
                self.allocators[index].free(table[start:end])
                table[start:end] = [SCRATCH_BLOCK] * (end - start)

    def tokens_that_fit(self, tables: Tables) -> int:
        """Tokens a sequence can cover with its blocks plus every free one (the scarcest group decides)."""
        return min(g.max_tokens(len(t) + a.num_free_blocks) for g, t, a in zip(self.groups, tables, self.allocators))

    def num_usable_tokens(self) -> int:
        """Tokens one sequence could grow to with every usable block (`CacheGroup.longest_sequence`: a group
        with a lookback that holds a one-token step at any length does not limit it)."""
        return min(g.longest_sequence(a.num_usable_blocks) for g, a in zip(self.groups, self.allocators))

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[Tables, tuple[list[BlockHash], ...], int]:
        """The longest cached prefix of `token_ids` every group holds, cut to `prefix_alignment` (see the
        module docstring: of a group with a lookback, only the blocks of the prefix's last lookback tokens).

        Returns (tables, hashes, num_tokens): per group the cached blocks (owned by the caller now;
        placeholders before a bounded group's tail) and the hashes of every block of the prefix,
        covering the first num_tokens tokens.
        """
        if not self.enable_prefix_caching:
            return self.empty_tables(), tuple([] for _ in self.groups), 0
        groups, alignment = self.groups, self.prefix_alignment
        hits = [None if g.lookback is not None else a.match_prefix(token_ids) for g, a in zip(groups, self.allocators)]
        covered = min((len(h.blocks) * g.tokens_per_block for g, h in zip(groups, hits) if h is not None),
                      default=len(token_ids))
        num_tokens = covered - covered % alignment
        chains = {i: hash_chain(token_ids[:num_tokens], groups[i].tokens_per_block) for i in self._bounded}

        def tail(i: int, n: int) -> list[int] | None:
            g = groups[i]
            return self.allocators[i].cached_blocks(chains[i][g.first_live_block(n) : n // g.tokens_per_block])

        while num_tokens > 0 and any(tail(i, num_tokens) is None for i in self._bounded):
            num_tokens -= alignment
        tables: list[list[int]] = []
        hashes: list[list[BlockHash]] = []
        for i, (g, hit, allocator) in enumerate(zip(groups, hits, self.allocators)):
            keep = num_tokens // g.tokens_per_block
            if hit is None:
                blocks = tail(i, num_tokens) or []
                allocator.take(blocks)
                tables.append([SCRATCH_BLOCK] * (keep - len(blocks)) + blocks)
                hashes.append(chains[i][:keep])
            else:
                allocator.free(hit.blocks[keep:])
                tables.append(list(hit.blocks[:keep]))
                hashes.append(list(hit.hashes[:keep]))
        return tuple(tables), tuple(hashes), num_tokens

    def register_full_blocks(self, tables: Tables, hashes: tuple[list[BlockHash], ...], token_ids: Sequence[int],
                             num_computed: int) -> None:
        """Register every block, in every group, that `num_computed` tokens have filled (a placeholder's hash
        is chained on without registering anything)."""
        # Called for every row of every step, where most calls fill no new block: one group (V2/V3) decides
        # that with one division.
        if self._only_block_size is not None and num_computed // self._only_block_size <= len(hashes[0]):
            return
        for per, table, known, allocator in zip(self._tokens_per_block, tables, hashes, self.allocators):
            for i in range(len(known), num_computed // per):
                parent = known[-1] if known else None
                tokens = token_ids[i * per : (i + 1) * per]
                block = table[i]
                known.append(hash_block(parent, tokens) if block == SCRATCH_BLOCK
                             else allocator.register(block, parent, tokens))

    def check_invariants(self, owners: Sequence[Mapping[int, int]] | None = None) -> None:
        """Each group's allocator invariants, and its owners' counts when given (one mapping per group)."""
        for g, allocator in enumerate(self.allocators):
            allocator.check_invariants(None if owners is None else owners[g])
