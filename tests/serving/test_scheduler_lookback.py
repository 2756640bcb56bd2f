"""A group 0 with a lookback: the scheduler frees what no later step reads, and nothing else.

A fake cache records, for every slot a step writes, which token prefix it holds (group 0: the tokens
up to its position; group 1: the tokens up to the one that completes its entry). Property-based:
random requests run to the end, with verify rows whose drafts are partly rejected, prefix caching
on or off, mixed steps or not, and pools sized by the engine's rule (`CacheGroup.blocks_in_flight`)
or tight enough to preempt. At every step:

* every slot a row reads -- group 0 from start_pos - lookback, every complete entry of group 1 --
  still holds its own sequence's prefix: no block a future query reads was freed (and reused);
* a row's table holds the scratch block behind its lookback only, and real blocks from there on;
* after each update, a sequence holds group-0 blocks for its last `lookback` tokens only
  (`CacheGroup.live_blocks`, at most ceil(lookback / block_size) + 1), and during a step at most
  that and its query's blocks, whatever its length;
* with group 0 sized by the rule and an ample group 1, nobody is ever preempted.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_func.serving.scheduler import Request, Scheduler, SchedulerConfig
from mla_func.state.block_allocator import SCRATCH_BLOCK
from mla_func.state.layer_cache import CacheGroup


@st.composite
def workloads(draw):
    bs, lookback = draw(st.integers(1, 4)), draw(st.integers(0, 9))
    rate, group_bs = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    seqs, drafts = draw(st.integers(1, 4)), draw(st.sampled_from([0, 0, 1, 2]))
    step_tokens = draw(st.integers(max(4, seqs * (drafts + 1)), 16))
    max_model_len = draw(st.integers(8, 48))
    ruled = draw(st.booleans())
    first = CacheGroup(2, bs, lookback=lookback)
    if ruled:
        # The engine's rule, and a group 1 that holds every sequence at its longest.
        blocks0 = first.blocks_in_flight(seqs, step_tokens)
        blocks1 = 1 + seqs * CacheGroup(2, group_bs, rate).blocks_for(max_model_len)
    else:
        # Room for one sequence's verify step at any length, little more.
        blocks0 = 1 + first.blocks_for(lookback + drafts + bs) + draw(st.integers(0, 4))
        blocks1 = draw(st.integers(3, 12))
    cfg = SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=step_tokens, max_model_len=max_model_len,
        cache_groups=(CacheGroup(blocks0, bs, lookback=lookback), CacheGroup(blocks1, group_bs, rate)),
        long_prefill_token_threshold=draw(st.sampled_from([None, 2, 5])), enable_mixed=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()), speculative_tokens=drafts)
    return cfg, ruled, draw(st.integers(0, 2**16))


class FakeCache:
    """Which token prefix each slot of each group holds, as steps write them."""

    def __init__(self, groups):
        self.groups = groups
        self.slots: list[dict[tuple[int, int], tuple[int, ...]]] = [{} for _ in groups]

    def slot(self, g: int, table, index: int) -> tuple[int, int]:
        block = table[index // self.groups[g].block_size]
        assert block != SCRATCH_BLOCK, f"group {g}: entry {index} is read or written through the scratch block"
        return block, index % self.groups[g].block_size

    def check_reads(self, tables, tokens, start: int) -> None:
        """What a row at `start` (or a later step of the sequence) reads holds its sequence's prefixes."""
        g0, g1 = self.groups
        for p in range(max(0, start - g0.lookback), start):
            assert self.slots[0].get(self.slot(0, tables[0], p)) == tuple(tokens[: p + 1]), ("group 0", p)
        for e in range(start // g1.tokens_per_entry):
            end = (e + 1) * g1.tokens_per_entry
            assert self.slots[1].get(self.slot(1, tables[1], e)) == tuple(tokens[:end]), ("group 1", e)

    def write(self, tables, tokens, start: int, stop: int) -> None:
        r = self.groups[1].tokens_per_entry
        for p in range(start, stop):
            self.slots[0][self.slot(0, tables[0], p)] = tuple(tokens[: p + 1])
            if (p + 1) % r == 0:
                self.slots[1][self.slot(1, tables[1], p // r)] = tuple(tokens[: p + 1])


def _held(table) -> int:
    return sum(b != SCRATCH_BLOCK for b in table)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_no_block_a_later_query_reads_is_freed_and_group_0_stays_bounded(workload):
    cfg, ruled, seed = workload
    rng = random.Random(seed)
    sched = Scheduler(cfg)
    g0, g1 = cfg.cache_groups
    cache = FakeCache(cfg.cache_groups)
    shared = [rng.randrange(40) for _ in range(30)]
    for i in range(rng.randint(1, 6)):
        n = rng.randint(1, min(30, cfg.max_model_len - 1))
        prompt = tuple(shared[:n] if rng.random() < 0.5 else [rng.randrange(40) for _ in range(n)])
        try:
            sched.add(Request(i, prompt, max_tokens=rng.randint(1, 12)))
        except ValueError as error:
            assert not ruled and "needs up to" in str(error)
    steps = 0
    while (step := sched.schedule()) is not None:
        steps += 1
        assert steps < 3000, "no progress"
        assert not (ruled and step.preempted), "a pool sized by the rule preempted"
        sched.check_invariants()
        sampled = []
        written = []
        num_prefill = len(step.plan.prefill)
        for i, (row, rid) in enumerate(zip(step.rows, step.request_ids)):
            seq = sched._seqs[rid]
            tables = (row.block_table, *row.group_block_tables)
            # Behind the lookback the scratch block only; from there on, real blocks.
            first = g0.first_live_block(row.start_pos)
            assert set(row.block_table[:first]) <= {SCRATCH_BLOCK}
            assert SCRATCH_BLOCK not in row.block_table[first:]
            q = row.num_tokens
            assert _held(row.block_table) <= -(-g0.lookback // g0.block_size) + -(-q // g0.block_size) + 1
            cache.check_reads(tables, seq.token_ids, row.start_pos)
            # A verify row feeds the last token, then drafts the fake engine makes up here.
            verify = i >= num_prefill and q > 1
            drafts = [rng.randrange(40) for _ in range(q - 1)] if verify else []
            fed = seq.token_ids[: row.start_pos + 1] + drafts if verify else seq.token_ids[: row.seq_len]
            written.append((tables, fed, row))
            if not row.num_logits:
                sampled.append(None)
            elif verify:
                accepted = rng.randint(0, q - 1)
                sampled.append(tuple(drafts[:accepted]) + (rng.randrange(40),))
            else:
                sampled.append(rng.randrange(40))
        held = sum(_held(s.tables[0]) for s in sched._running)
        assert held <= g0.blocks_in_flight(cfg.max_num_seqs, cfg.max_num_batched_tokens) - 1
        for tables, fed, row in written:
            cache.write(tables, fed, row.start_pos, row.seq_len)
        sched.update(step, sampled)
        sched.check_invariants()
        for seq in sched._running:
            n = seq.num_computed
            cache.check_reads(seq.tables, seq.token_ids, n)
            assert _held(seq.tables[0]) == g0.live_blocks(n) <= -(-g0.lookback // g0.block_size) + 1
    for allocator in sched.blocks.allocators:
        allocator.check_invariants({})
        assert allocator.num_free_blocks == allocator.num_usable_blocks
