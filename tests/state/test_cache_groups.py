"""A second cache group with another tokens-per-entry ratio, through allocator, scheduler, batch and forward.

Property-based: random requests run to the end through the scheduler with a
group 0 of one entry per token and a group 1 of one entry per `ratio` tokens.
Every step: each allocator's owners match the running sequences' tables (no
leak, no double ownership), every row's tables cover its positions, the batch
built from the step addresses only the row's own blocks, and padding writes no
group. At the end every block of every group is free. A toy layer kind with a
leaf in group 1 then shows padding inert for every leaf of the state.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_func as mf
from mla_func.models.mla.layer import MLA_DECODER
from mla_func.pytree import register_dataclass, static_field
from mla_func.serving.scheduler import Request, Scheduler, SchedulerConfig
from mla_func.state.kv_cache import KVCacheState
from mla_func.state.layer_cache import CacheGroup


@st.composite
def configs(draw):
    block_size = draw(st.integers(1, 4))
    ratio = draw(st.integers(2, 4))
    group_block_size = draw(st.integers(1, 3))
    cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 4)), max_num_batched_tokens=draw(st.integers(4, 16)),
        cache_groups=(CacheGroup(draw(st.integers(6, 24)), block_size),
                      CacheGroup(draw(st.integers(4, 16)), group_block_size, ratio)),
        max_model_len=draw(st.integers(8, 40)),
        long_prefill_token_threshold=draw(st.sampled_from([None, 3, 5])), enable_mixed=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()),
        carry_periods=(draw(st.sampled_from([1, ratio])),),
    )
    return cfg


def _check_batch(plan, cfg, groups, ladder_extra):
    padding = mf.PaddingPolicy(
        decode_seqs=(len(plan.decode) + ladder_extra,) if plan.decode else (),
        prefill_tokens=(plan.num_prefill_tokens + ladder_extra,) if plan.prefill else (),
        prefill_seqs=(len(plan.prefill) + ladder_extra,) if plan.prefill else (),
    )
    mode = mf.ForwardMode.decide(plan, cache_groups=groups, padding=padding)
    batch = mf.build_batch(plan, mode, device="cpu", num_blocks=cfg.num_blocks)
    g = groups[1]
    (meta,) = batch.groups
    slots = meta.slot_mapping.tolist()
    real = batch.real_rows().tolist()
    # Row by row: real rows write exactly the entries they complete, in their own blocks.
    for seqs, first in ((plan.prefill, 0), (plan.decode, mode.padded_prefill_tokens)):
        r = first
        for seq in seqs:
            table = seq.group_block_tables[0]
            for p in range(seq.start_pos, seq.seq_len):
                assert real[r]
                if (p + 1) % g.tokens_per_entry:
                    assert slots[r] == -1
                else:
                    e = p // g.tokens_per_entry
                    assert slots[r] == table[e // g.block_size] * g.block_size + e % g.block_size
                r += 1
    # Padding rows write no group; padded sequences' tables are all scratch.
    for row, ok in enumerate(real):
        if not ok:
            assert slots[row] == -1 and batch.slot_mapping[row] == -1
    for table, n in ((meta.prefill_block_table, len(plan.prefill)), (meta.decode_block_table, len(plan.decode))):
        if table is not None:
            assert bool((table[n:] == 0).all())


@settings(max_examples=40, deadline=None)
@given(cfg=configs(), seed=st.integers(0, 2**16), ladder_extra=st.integers(0, 2))
def test_two_groups_through_scheduler_and_batch(cfg, seed, ladder_extra):
    rng = random.Random(seed)
    sched = Scheduler(cfg)
    groups = cfg.cache_groups
    shared = [rng.randrange(50) for _ in range(12)]
    for i in range(rng.randint(1, 6)):
        prompt = tuple(shared[: rng.randint(1, 12)] if rng.random() < 0.5 else
                       [rng.randrange(50) for _ in range(rng.randint(1, 12))])
        request = Request(i, prompt, max_tokens=rng.randint(1, 8))
        held = min(len(prompt) + request.max_tokens, cfg.max_model_len) - 1  # the most tokens it caches
        too_big = len(prompt) >= cfg.max_model_len or any(
            held >= ((g.num_blocks - 1) * g.block_size + 1) * g.tokens_per_entry for g in groups)
        if too_big:
            with pytest.raises(ValueError, match=f"request {i}"):
                sched.add(request)
        else:
            sched.add(request)
    assert sched.blocks.prefix_alignment == math.lcm(*(g.tokens_per_block for g in groups), *cfg.carry_periods)
    steps = 0
    while (step := sched.schedule()) is not None:
        steps += 1
        assert steps < 5000, "no progress"
        for row in step.rows:
            (table,) = row.group_block_tables
            assert len(table) == groups[1].blocks_for(row.seq_len) and 0 not in table
            assert len(row.block_table) == -(-row.seq_len // cfg.block_size)
        _check_batch(step.plan, cfg, groups, ladder_extra)
        sampled = [rng.randrange(50) if row.num_logits else None for row in step.rows]
        sched.update(step, sampled)
        sched.check_invariants()
    for allocator in sched.blocks.allocators:
        allocator.check_invariants({})
        assert allocator.num_free_blocks == allocator.num_usable_blocks


def test_prefix_hits_stop_where_every_group_is_aligned():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                          cache_groups=(CacheGroup(32, 2), CacheGroup(32, 1, 3)))
    sched = Scheduler(cfg)
    prompt = tuple(range(1, 15))  # 14 tokens
    sched.add(Request("a", prompt, max_tokens=1))
    step = sched.schedule()
    sched.update(step, [7])  # "a" finishes; its full blocks stay cached
    sched.add(Request("b", prompt + (20,), max_tokens=1))
    (row,) = sched.schedule().rows
    # Group 0 caches blocks of 2 tokens, group 1 of 3: hits are cut to multiples of 6.
    assert row.start_pos == 12 and row.block_table[:6] == step.rows[0].block_table[:6]


@register_dataclass
@dataclasses.dataclass(frozen=True, slots=True)
class EntryCache:
    entries: torch.Tensor  # [num_blocks_1, block_size_1, D] in cache group 1
    group: int = static_field(default=1)

    def paged(self):
        return (self.entries,)

    def paged_in(self, group):
        return self.paged() if group == self.group else ()


@dataclasses.dataclass(frozen=True, slots=True)
class EntryLayer:
    """Writes its input of every entry-completing token into cache group 1; changes nothing else."""

    name: str = "entries"

    def lookback(self, config):
        return None

    def init_cache(self, config, groups, *, dtype, device):
        g = groups[1]
        return EntryCache(torch.zeros(g.num_blocks, g.block_size, config.hidden_size, dtype=dtype, device=device))

    def enter(self, p, delta, residual, ctx):
        residual = delta if residual is None else residual + delta
        return residual, residual

    def body(self, p, entered, residual, cache, ctx):
        slots = ctx.batch.groups[cache.group - 1].slot_mapping
        entries = cache.entries if ctx.inplace else cache.entries.clone()
        keep = slots >= 0
        entries.view(-1, entries.shape[-1]).index_copy_(0, slots[keep], entered[keep])
        return torch.zeros_like(entered), residual, EntryCache(entries, cache.group)


@pytest.fixture(scope="module")
def tiny():
    return mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=61)


def test_padding_is_inert_for_every_leaf_of_two_groups(tiny):
    model = tiny
    groups = (CacheGroup(16, 4), CacheGroup(8, 2, 3))
    kinds = (*mf.layer_kinds(model.config), EntryLayer())
    params = dataclasses.replace(model.params, layers=(*model.params.layers, None))
    caches = [k.init_cache(model.config, groups, dtype=model.dtype, device="cpu") for k in kinds]
    state = KVCacheState.checked(caches, groups=groups)
    assert kinds[0] is MLA_DECODER and len(state.leaves()) == len(kinds)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(range(3, 10)), 0, (1, 2), 1, ((1, 2),)),
                                mf.SeqPlan((4, 5, 6), 0, (3,), 1, ((3,),))))
    exact = mf.ForwardMode.decide(plan, cache_groups=groups)
    padded = mf.ForwardMode.decide(plan, cache_groups=groups, padding=mf.PaddingPolicy(
        prefill_tokens=(16,), prefill_seqs=(4,), block_table_widths=(5,)))
    assert padded.num_tokens == 16 and padded.group_widths == (4,) and exact.group_widths == (2,)
    (_, exact_state), (_, padded_state) = _exact_and_padded(params, state, plan, exact, padded, kinds)
    entries = padded_state.layers[-1].entries
    # Sequence 0 completes entries 0 and 1 (positions 2, 5) in its block 1; sequence 1 entry 0 in block 3.
    assert bool(entries[1].abs().sum(-1).gt(0).all()) and bool(entries[3, 0].abs().sum() > 0)
    assert bool((entries[3, 1] == 0).all()) and bool((entries[2] == 0).all())


def _exact_and_padded(params, state, plan, exact, padded, kinds):
    """Run `plan` at both modes (copy=True); assert equal real logits and equal leaves outside scratch."""
    outs = []
    for mode in (exact, padded):
        batch = mf.build_batch(plan, mode, device="cpu", num_blocks=state.num_blocks)
        logits, new = mf.forward(params, state, batch, mode, copy=True, layers=kinds)
        outs.append((logits[: mode.num_logits], new))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(outs[0][1].leaves(), outs[1][1].leaves()):
        torch.testing.assert_close(a[1:], b[1:], rtol=1e-12, atol=1e-12)  # block 0 is scratch
    return outs


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=2), context=st.integers(1, 8),
       q_len=st.integers(1, 3), ratio=st.integers(2, 3), extra=st.tuples(st.integers(0, 5), st.integers(0, 2),
                                                                       st.integers(0, 2), st.integers(0, 2)))
def test_padding_is_inert_for_every_leaf_in_mixed_steps(tiny, lengths, context, q_len, ratio, extra):
    """Any mixed step of prefill chunks and verify rows, padded any way, leaves every leaf of both groups alone."""
    model = tiny
    groups = (CacheGroup(32, 2), CacheGroup(32, 1, ratio))
    kinds = (*mf.layer_kinds(model.config), EntryLayer())
    params = dataclasses.replace(model.params, layers=(*model.params.layers, None))
    state = KVCacheState.checked([k.init_cache(model.config, groups, dtype=model.dtype, device="cpu") for k in kinds],
                                 groups=groups)
    tables = [tuple(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    ctx_plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(range(5, 5 + context)), 0, tables[2], 0, (tables[2],)),))
    mode = mf.ForwardMode.decide(ctx_plan, cache_groups=groups)
    _, state = mf.forward(params, state, mf.build_batch(ctx_plan, mode, device="cpu"), mode, layers=kinds)
    plan = mf.StepPlan(
        prefill=tuple(mf.SeqPlan(tuple(range(2, 2 + n)), 0, tables[i], 1, (tables[i],)) for i, n in enumerate(lengths)),
        decode=(mf.SeqPlan(tuple(range(40, 40 + q_len)), context, tables[2], q_len, (tables[2],)),),
        decode_q_len=q_len,
    )
    exact = mf.ForwardMode.decide(plan, cache_groups=groups)
    tokens, pseqs, dseqs, width = extra
    padded = mf.ForwardMode.decide(plan, cache_groups=groups, padding=mf.PaddingPolicy(
        prefill_tokens=(exact.padded_prefill_tokens + tokens,), prefill_seqs=(exact.padded_prefill_seqs + pseqs,),
        decode_seqs=(1 + dseqs,), block_table_widths=(exact.block_table_width + width,)))
    assert padded.num_tokens == exact.num_tokens + tokens + dseqs * q_len
    _exact_and_padded(params, state, plan, exact, padded, kinds)
