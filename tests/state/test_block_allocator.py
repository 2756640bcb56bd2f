"""BlockAllocator: refcounts, all-or-nothing errors, prefix caching and LRU eviction.

The stateful test drives the allocator the way the scheduler does (look up a
prefix, allocate the rest, register the full blocks, free) and checks it
against a model that knows nothing of hashes: a cached block is identified by
the whole token prefix it ends, and eviction order is tracked from the order in
which blocks were released.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from mla_func.state.block_allocator import BlockAllocator, OutOfBlocks, hash_block


def test_scratch_block_is_never_handed_out():
    alloc = BlockAllocator(num_blocks=5, block_size=2)
    blocks = alloc.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocks, match="asked for 1 blocks, only 0 of 4"):
        alloc.allocate(1)
    with pytest.raises(ValueError, match="scratch block"):
        alloc.free([0])
    alloc.check_invariants(Counter(blocks))


def test_out_of_blocks_allocates_nothing():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    held = alloc.allocate(3)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(3)
    assert alloc.num_free_blocks == 2
    alloc.check_invariants(Counter(held))


def test_double_free_raises_and_changes_nothing():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    a, b = alloc.allocate(2)
    alloc.free([a])
    with pytest.raises(ValueError, match=f"double free of block {a}"):
        alloc.free([b, a])  # b must stay owned: the call is all or nothing
    assert alloc.refcount(b) == 1
    with pytest.raises(ValueError, match=f"double free of block {b}"):
        alloc.free([b, b])
    alloc.check_invariants({b: 1})


def test_register_checks_fullness_and_ownership():
    alloc = BlockAllocator(num_blocks=4, block_size=3)
    (blk,) = alloc.allocate(1)
    with pytest.raises(ValueError, match="got 2 token ids for block"):
        alloc.register(blk, None, [1, 2])
    alloc.free([blk])
    with pytest.raises(ValueError, match="not owned"):
        alloc.register(blk, None, [1, 2, 3])


def test_shared_prefix_is_reused_and_survives_until_evicted():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    first = alloc.allocate(3)
    h0 = alloc.register(first[0], None, tokens[0:2])
    h1 = alloc.register(first[1], h0, tokens[2:4])
    assert (h0, h1) == (hash_block(None, [5, 6]), hash_block(h0, [7, 8]))
    hit = alloc.match_prefix(tokens)
    assert hit.blocks == tuple(first[:2]) and hit.hashes == (h0, h1)
    assert alloc.refcount(first[0]) == 2
    alloc.free(first)
    alloc.free(hit.blocks)
    # Unowned but cached: a later lookup still finds them.
    assert alloc.num_free_blocks == 3
    again = alloc.match_prefix([5, 6, 7, 8])
    assert again.blocks == tuple(first[:2])
    alloc.free(again.blocks)
    # Taking every block evicts both cached ones; the prefix is gone.
    alloc.free(alloc.allocate(3))
    assert alloc.match_prefix([5, 6, 7, 8]).blocks == ()
    alloc.check_invariants({})


def test_prefix_depends_on_the_parent():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    a, b = alloc.allocate(2)
    h = alloc.register(a, None, [1, 2])
    alloc.register(b, h, [3, 4])
    # Same second block after a different first block is not a hit.
    assert alloc.match_prefix([9, 9, 3, 4]).blocks == ()
    assert alloc.match_prefix([1, 2, 3, 4]).blocks == (a, b)


class AllocatorMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 3))
    def setup(self, num_blocks, block_size):
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.bs = block_size
        self.owned: list[list[int]] = []  # block lists of the live sequences
        # The model of the cache: prefix tuple <-> block, and evictable blocks oldest release first.
        self.cached: dict[tuple[int, ...], int] = {}
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.release_order: list[int] = []

    def _owner_counts(self) -> Counter:
        return Counter(b for blocks in self.owned for b in blocks)

    def _model_free(self) -> int:
        owned = set(self._owner_counts())
        return sum(1 for b in range(1, self.alloc.num_blocks) if b not in owned and b not in self.prefix_of)

    def _allocate(self, n: int) -> list[int]:
        evictions_expected = max(0, n - self._model_free())
        expected_evicted = self.release_order[:evictions_expected]
        got = self.alloc.allocate(n)
        evicted = [b for b in got if b in self.prefix_of]
        assert sorted(evicted) == sorted(expected_evicted), "eviction is not least recently released first"
        owned = set(self._owner_counts())
        assert not (set(got) & owned), "a fresh block is already owned"
        assert 0 not in got and len(set(got)) == n
        for b in evicted:
            del self.cached[self.prefix_of.pop(b)]
            self.release_order.remove(b)
        return got

    @rule(target=seqs, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def new_seq(self, tokens):
        owners_before = self._owner_counts()
        hit = self.alloc.match_prefix(tokens)
        # The model's longest chain of cached prefixes.
        expected = []
        for i in range(len(tokens) // self.bs):
            blk = self.cached.get(tuple(tokens[: (i + 1) * self.bs]))
            if blk is None:
                break
            expected.append(blk)
        assert list(hit.blocks) == expected
        for b in hit.blocks:
            if b in self.release_order:
                self.release_order.remove(b)
        self.owned.append(list(hit.blocks))  # owned now, in case allocate fails below
        need = -(-len(tokens) // self.bs) - len(hit.blocks)
        if need > self._model_free() + len(self.release_order):
            with pytest.raises(OutOfBlocks):
                self.alloc.allocate(need)
            self._free_seq(self.owned.pop())
            assert self._owner_counts() == owners_before
            return []
        blocks = list(hit.blocks) + self._allocate(need)
        self.owned[-1] = blocks
        parent = hit.hashes[-1] if hit.hashes else None
        for i in range(len(hit.blocks), len(tokens) // self.bs):
            parent = self.alloc.register(blocks[i], parent, tokens[i * self.bs : (i + 1) * self.bs])
            prefix = tuple(tokens[: (i + 1) * self.bs])
            if prefix not in self.cached:  # an existing cached copy wins
                self.cached[prefix] = blocks[i]
                self.prefix_of[blocks[i]] = prefix
        return blocks

    def _free_seq(self, blocks):
        self.alloc.free(blocks)
        counts = self._owner_counts()
        for b in reversed(blocks):
            if counts[b] == 0 and b in self.prefix_of and b not in self.release_order:
                self.release_order.append(b)

    @rule(blocks=consumes(seqs))
    def free_seq(self, blocks):
        if not blocks:
            return
        self.owned.remove(blocks)
        self._free_seq(blocks)

    @rule(n=st.integers(0, 14))
    def allocate_and_free(self, n):
        if n > self._model_free() + len(self.release_order):
            before = self.alloc.num_free_blocks
            with pytest.raises(OutOfBlocks):
                self.alloc.allocate(n)
            assert self.alloc.num_free_blocks == before
            return
        got = self._allocate(n)
        self.owned.append(got)
        self._free_seq(self.owned.pop())

    @rule(block=st.integers(0, 12))
    def free_unowned_raises(self, block):
        if self._owner_counts()[block] == 0:
            with pytest.raises(ValueError):
                self.alloc.free([block])

    @invariant()
    def consistent(self):
        if hasattr(self, "alloc"):
            self.alloc.check_invariants(self._owner_counts())
            assert self.alloc.num_cached_blocks == len(self.cached)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
