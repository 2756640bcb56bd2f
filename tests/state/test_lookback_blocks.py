"""A cache group with a lookback: its block arithmetic, and the allocator that frees behind it.

`CacheGroup`'s counts are checked against brute force; `GroupedAllocator.free_behind` frees exactly
the blocks wholly behind the lookback and leaves the scratch block in their place, which freeing,
truncating and registering skip; a prefix hit takes a bounded group's blocks of the prefix's last
`lookback` tokens only, and is cut back (by the alignment) where one of them was evicted.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_func.state.block_allocator import SCRATCH_BLOCK, hash_block, hash_chain
from mla_func.state.cache_groups import GroupedAllocator
from mla_func.state.layer_cache import CacheGroup


@settings(max_examples=200, deadline=None)
@given(lookback=st.integers(0, 40), block_size=st.integers(1, 8), tokens=st.integers(0, 200))
def test_the_block_counts_of_a_bounded_group_are_the_brute_forces(lookback, block_size, tokens):
    g = CacheGroup(2, block_size, lookback=lookback)

    def kept(n: int, end: int) -> int:
        """Blocks of a table covering `end` tokens that are not wholly before n - lookback."""
        return sum((b + 1) * block_size > n - lookback for b in range(-(-end // block_size)))

    # Live: what a sequence of n tokens keeps; peak: the most over every length up to n.
    live = [kept(n, n) for n in range(tokens + 1)]
    assert g.live_blocks(tokens) == live[-1]
    assert g.first_live_block(tokens) == g.blocks_for(tokens) - live[-1]
    assert g.peak_blocks(tokens) == max(live)
    # A step of q tokens at n holds those and the blocks up to n + q: within the rule's share.
    for q in (1, 3, 17):
        assert kept(tokens, tokens + q) <= -(-lookback // block_size) + -(-q // block_size) + 1
    assert g.longest_sequence(g.blocks_for(lookback + block_size)) == sys.maxsize
    assert g.longest_sequence(g.blocks_for(lookback + block_size) - 1) == g.max_tokens(
        g.blocks_for(lookback + block_size) - 1)


def test_a_group_without_a_lookback_keeps_every_block():
    g = CacheGroup(2, 4)
    assert g.first_live_block(100) == 0 and g.live_blocks(100) == g.peak_blocks(100) == 25
    assert g.longest_sequence(10) == g.max_tokens(10) == 40
    with pytest.raises(ValueError, match="a group without a lookback holds whole sequences"):
        g.blocks_in_flight(4, 16)


def test_bad_lookbacks_are_refused_by_name():
    with pytest.raises(ValueError, match="CacheGroup.lookback: must be None or >= 0, got -1"):
        CacheGroup(2, 4, lookback=-1)
    with pytest.raises(ValueError, match="only a group of one entry per token has one, got lookback 3 with "
                                         "tokens_per_entry 4"):
        CacheGroup(2, 4, 4, lookback=3)


def _allocator(lookback=5, caching=True):
    # Group 0: blocks of 2 tokens, read back `lookback` tokens; group 1: one entry a 2 tokens, 2 a block.
    return GroupedAllocator((CacheGroup(16, 2, lookback=lookback), CacheGroup(16, 2, 2)),
                            enable_prefix_caching=caching)


def test_free_behind_frees_what_lies_wholly_behind_the_lookback():
    a = _allocator()
    tables = a.empty_tables()
    a.allocate(tables, a.blocks_needed(tables, 13))                       # 7 blocks of group 0, 3 of group 1
    blocks = list(tables[0])
    a.free_behind(tables, 13)                                            # 13 - 5 = 8: blocks 0..3 hold 0..7
    assert tables[0] == [SCRATCH_BLOCK] * 4 + blocks[4:] and len(tables[1]) == 3
    assert a.allocators[0].num_free_blocks == 15 - 3
    a.free_behind(tables, 13)                                            # again: nothing more
    assert a.allocators[0].num_free_blocks == 15 - 3
    # The table stays positional: covering more tokens appends after the placeholders.
    assert a.blocks_needed(tables, 16) == (1, 1)
    a.allocate(tables, a.blocks_needed(tables, 16))
    a.free_behind(tables, 16)                                            # 16 - 5 = 11: blocks 0..4
    assert tables[0][:5] == [SCRATCH_BLOCK] * 5 and SCRATCH_BLOCK not in tables[0][5:]
    a.truncate(tables, 12)                                               # placeholders are skipped
    assert len(tables[0]) == 6
    a.free(tables)
    a.check_invariants([{}, {}])
    assert [x.num_free_blocks for x in a.allocators] == [15, 15]


def test_freed_full_blocks_stay_cached_and_a_hit_takes_the_tail_only():
    a = _allocator()
    prompt = list(range(100, 124))                                       # 24 tokens
    tables, hashes = a.empty_tables(), ([], [])
    a.allocate(tables, a.blocks_needed(tables, 24))
    a.register_full_blocks(tables, hashes, prompt, 24)
    a.free_behind(tables, 24)                                            # 24 - 5 = 19: blocks 0..8 freed
    assert a.allocators[0].num_cached_blocks == 12 and a.allocators[0].num_free_blocks == 15 - 3
    a.free(tables)
    # Alignment lcm(2, 4) = 4: a hit of 20 tokens takes group 0's blocks of [15, 20) (blocks 7..9), and
    # group 1's of [0, 20); the earlier group-0 blocks are placeholders, their hashes chained from the tokens.
    assert a.prefix_alignment == 4
    hit_tables, hit_hashes, n = a.match_prefix(prompt[:21] + [7, 8, 9])
    assert n == 20
    assert hit_tables[0][:7] == [SCRATCH_BLOCK] * 7 and len(hit_tables[0]) == 10 and 0 not in hit_tables[0][7:]
    assert hit_hashes[0] == hash_chain(prompt[:20], 2) and len(hit_tables[1]) == len(hit_hashes[1]) == 5
    # Registering goes on from the hit: the chain continues over the placeholders' hashes.
    a.allocate(hit_tables, a.blocks_needed(hit_tables, 24))
    a.register_full_blocks(hit_tables, hit_hashes, prompt[:21] + [7, 8, 9], 24)
    assert hit_hashes[0][10] == hash_block(hit_hashes[0][9], [120, 7])
    a.free(hit_tables)
    a.check_invariants([{}, {}])


@pytest.mark.parametrize("evicted,hit", [(0, 24), (1, 20), (2, 20), (3, 16), (4, 16), (5, 12)])
def test_a_hit_is_cut_back_where_a_tail_block_was_evicted(evicted, hit):
    a = _allocator()
    prompt = list(range(100, 124))
    tables, hashes = a.empty_tables(), ([], [])
    a.allocate(tables, a.blocks_needed(tables, 24))
    a.register_full_blocks(tables, hashes, prompt, 24)
    a.free(tables)   # released last block first: blocks 11, 10, 9, ... of the table are evicted in that order
    g0 = a.allocators[0]
    g0.allocate(g0.num_free_blocks - 12 + evicted)
    # A hit of n needs group 0's blocks of [n - 5, n): 24 blocks 9..11, 20 blocks 7..9, 16 blocks 5..7,
    # 12 blocks 3..5; where one is gone the hit steps back by the alignment (4).
    hit_tables, _, n = a.match_prefix(prompt)
    assert n == hit
    first = (n - 5) // 2
    assert hit_tables[0][:first] == [SCRATCH_BLOCK] * first and SCRATCH_BLOCK not in hit_tables[0][first:]
    assert len(hit_tables[1]) == n // 4


def test_a_hit_with_prefix_caching_off_is_empty():
    assert _allocator(caching=False).match_prefix(list(range(24))) == (([], []), ([], []), 0)
