"""A plan's group-0 table may hold the scratch block behind the group's lookback, and nowhere else.

The batch builder checks the blocks a step reads and writes: with a lookback L, a sequence at
start_pos reads group 0 from start_pos - L, so the blocks wholly before it may be placeholders of
freed blocks (the scheduler's positional tables), and the batch's table keeps them in place.
"""

from __future__ import annotations

import pytest

import mla_func as mf
from mla_func.core.plan_checks import BatchError
from mla_func.state.block_allocator import SCRATCH_BLOCK

BOUNDED = (mf.CacheGroup(32, 4, lookback=6),)


def _build(groups, start, table, tokens=2, decode=False):
    seq = mf.SeqPlan(tuple(range(5, 5 + tokens)), start, table, 1)
    plan = mf.StepPlan(decode=(seq,), decode_q_len=tokens) if decode else mf.StepPlan(prefill=(seq,))
    mode = mf.ForwardMode.decide(plan, cache_groups=groups)
    return mf.build_batch(plan, mode, device="cpu", num_blocks=groups[0].num_blocks)


@pytest.mark.parametrize("decode", [False, True])
def test_placeholders_behind_the_lookback_are_taken_in_place(decode):
    # Positions 18, 19 read back to 12: blocks 0..2 (positions 0..11) are behind it.
    table = (SCRATCH_BLOCK,) * 3 + (7, 8)
    batch = _build(BOUNDED, 18, table, decode=decode)
    tables = batch.decode.block_table if decode else batch.prefill.block_table
    assert tables[0].tolist() == list(table)
    assert batch.slot_mapping[:2].tolist() == [8 * 4 + 2, 8 * 4 + 3]


@pytest.mark.parametrize("start,table", [
    (18, (SCRATCH_BLOCK,) * 4 + (8,)),   # block 3 holds positions 12..15, which the step reads
    (18, (1, 2, 3, 4, SCRATCH_BLOCK)),   # the block the step writes
    (6, (SCRATCH_BLOCK, 2)),             # 6 - 6 = 0: nothing is behind the lookback yet
])
def test_the_scratch_block_where_the_step_reads_or_writes_is_refused(start, table):
    with pytest.raises(BatchError, match="scratch block and cannot hold a sequence"):
        _build(BOUNDED, start, table)


def test_without_a_lookback_every_block_must_be_real():
    with pytest.raises(BatchError, match="scratch block and cannot hold a sequence$"):
        _build((mf.CacheGroup(32, 4),), 18, (SCRATCH_BLOCK,) * 3 + (7, 8))
