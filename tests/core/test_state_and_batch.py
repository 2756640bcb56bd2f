"""Donated state, the batch/mode shape contract, padding, and purity under torch.func."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_func as mf
from mla_func.models.mla.params import MoEParams
from support.hand_plans import Seq, blocks, decode_plan, prefill_plan, run
from support.mla_reference import rel_err

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=3)


def fresh_state(model, num_blocks=64):
    return mf.init_state(model.config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=model.dtype)


def one_prefill(tokens, index=0, cached=0):
    return mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), cached, blocks(index, 8), 1),))


def test_reusing_a_donated_state_raises(model):
    state = fresh_state(model)
    batch, mode = mf.plan_step(model.config, state, one_prefill([3, 4, 5]))
    _, new_state = mf.prefill(model.params, state, batch, mode)
    with pytest.raises(mf.DonatedStateError, match="donated to prefill"):
        mf.prefill(model.params, state, batch, mode)
    with pytest.raises(mf.DonatedStateError):
        mf.plan_step(model.config, state, one_prefill([3])) and mf.forward(model.params, state, batch, mode)
    mf.forward(model.params, new_state, *mf.plan_step(model.config, new_state, one_prefill([6], cached=3)))


def test_copy_keeps_the_old_state_valid_and_unchanged(model):
    state = fresh_state(model)
    before = [c.clone() for c in state.leaves()]
    batch, mode = mf.plan_step(model.config, state, one_prefill([3, 4, 5]))
    logits_a, branch_a = mf.forward(model.params, state, batch, mode, copy=True)
    for old, now in zip(before, state.leaves()):
        assert torch.equal(old, now)
    logits_b, branch_b = mf.forward(model.params, state, batch, mode, copy=True)
    assert torch.equal(logits_a, logits_b)
    assert not branch_a.is_donated and not state.is_donated


def test_segment_functions_refuse_the_other_kind(model):
    state = fresh_state(model)
    batch, mode = mf.plan_step(model.config, state, one_prefill([3, 4]))
    with pytest.raises(ValueError, match="expected a decode mode"):
        mf.decode(model.params, state, batch, mode)


def test_shape_contract_violation_raises_with_expected_and_got(model):
    state = fresh_state(model)
    batch, mode = mf.plan_step(model.config, state, one_prefill([3, 4, 5, 6]))
    # slot_mapping longer than input_ids: the mismatch of lesson L1
    bad = dataclasses.replace(batch, slot_mapping=torch.cat([batch.slot_mapping, batch.slot_mapping]))
    with pytest.raises(mf.BatchError, match=r"slot_mapping: expected shape \(4,\) from the mode, got \(8,\)"):
        mf.forward(model.params, state, bad, mode)
    bad_meta = dataclasses.replace(batch, prefill=dataclasses.replace(batch.prefill, cu_seqlens_q=torch.zeros(5, dtype=torch.int32)))
    with pytest.raises(mf.BatchError, match="cu_seqlens_q"):
        mf.forward(model.params, state, bad_meta, mode)
    assert not state.is_donated  # a refused call consumes nothing


@pytest.mark.parametrize(
    "plan, message",
    [
        (mf.StepPlan(prefill=(mf.SeqPlan((), 0, (1,)),)), "token_ids is empty"),
        (mf.StepPlan(prefill=(mf.SeqPlan((), 3, (1,), num_logits=0),)), "token_ids is empty"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1, 2), -1, (1,)),)), "start_pos must be >= 0"),
        (mf.StepPlan(decode=(mf.SeqPlan((7,), 4, (1, 0)),)), "scratch block"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1,), 0, (2,)),), decode=(mf.SeqPlan((-3,), 4, (1, 3)),)),
         r"token ids must be in \[0, 512\)"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1, 2, 3, 4, 5), 0, (1,)),)), "expected >= 2 blocks, got 1"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1, 2), 0, (0,)),)), "scratch block"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1, 2), 0, (999,)),)), r"block ids must be in \[1, 64\)"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1, 100000), 0, (1,)),)), r"token ids must be in \[0, 512\)"),
        (mf.StepPlan(decode=(mf.SeqPlan((1, 2), 3, (1, 2)),)), "expected one token"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1,), 0, (1,)), mf.SeqPlan((2,), 0, (1,)))), "same cache slot"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1,), 2048, tuple(range(1, 514))),)), "positions reach 2048, the model.s maximum is 2047"),
        (mf.StepPlan(prefill=(mf.SeqPlan((1, 2), 0, (1,), num_logits=3),)), r"num_logits must be in \[0, 2\]"),
    ],
)
def test_bad_plans_are_refused_on_the_host(model, plan, message):
    state = fresh_state(model)
    if "maximum" in message:
        state = fresh_state(model, num_blocks=600)
    with pytest.raises(mf.BatchError, match=message):
        mf.plan_step(model.config, state, plan)


def test_an_empty_plan_is_refused():
    with pytest.raises(ValueError, match="at least one sequence"):
        mf.ForwardMode.decide(mf.StepPlan(), cache_groups=(mf.CacheGroup(16, 4),))


def test_decide_pads_to_ladders_and_falls_back_above_them():
    ladder = mf.PaddingPolicy(decode_seqs=(1, 2, 4, 8), prefill_tokens=(16, 32), prefill_seqs=(2, 4), block_table_widths=(4, 8))
    groups = (mf.CacheGroup(num_blocks=16, block_size=4),)
    decode = mf.StepPlan(decode=tuple(mf.SeqPlan((1,), 5, (1, 2)) for _ in range(3)))
    mode = mf.ForwardMode.decide(decode, cache_groups=groups, padding=ladder, graphs=True)
    assert (mode.kind, mode.padded_decode_seqs, mode.block_table_width, mode.use_graph) == ("decode", 4, 4, True)
    assert mode.num_tokens == 4 and mode.padded_num_logits == 4
    big = mf.StepPlan(decode=tuple(mf.SeqPlan((1,), 5, (1, 2)) for _ in range(9)))
    mode = mf.ForwardMode.decide(big, cache_groups=groups, padding=ladder, graphs=True)
    assert (mode.padded_decode_seqs, mode.use_graph) == (9, False)
    assert mf.ForwardMode.decide(decode, cache_groups=groups, padding=ladder, graphs=False).use_graph is False


@settings(max_examples=25, deadline=None)
@given(
    prefill_lens=st.lists(st.integers(1, 9), min_size=0, max_size=3),
    decode_ctx=st.lists(st.integers(1, 10), min_size=0, max_size=3),
    extra=st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(0, 3), st.integers(0, 2)),
)
def test_padding_changes_nothing_for_real_rows(model, prefill_lens, decode_ctx, extra):
    """Padded rows, sequences and block-table columns leave every real row's logits and cache untouched."""
    if not prefill_lens and not decode_ctx:
        prefill_lens = [3]
    vocab = model.config.vocab_size
    seqs = [Seq(blocks(i, 6)) for i in range(len(prefill_lens) + len(decode_ctx))]
    state = fresh_state(model)
    # give the decode sequences their context first
    for j, ctx in enumerate(decode_ctx):
        seq = seqs[len(prefill_lens) + j]
        _, state = run(model, state, mf.StepPlan(prefill=(prefill_plan(seq, [(7 * j + k) % vocab for k in range(ctx)], all_logits=False),)))
        seq.cached = ctx
    plan = mf.StepPlan(
        prefill=tuple(prefill_plan(seqs[i], [(3 * i + k) % vocab for k in range(n)], all_logits=False) for i, n in enumerate(prefill_lens)),
        decode=tuple(decode_plan(seqs[len(prefill_lens) + j], 11 + j) for j in range(len(decode_ctx))),
    )
    exact_batch, exact_mode = mf.plan_step(model.config, state, plan)
    exact_logits, exact_state = mf.forward(model.params, state, exact_batch, exact_mode, copy=True)

    tokens_pad, pseq_pad, dseq_pad, width_pad = extra
    padded_mode = dataclasses.replace(
        exact_mode,
        padded_prefill_tokens=exact_mode.padded_prefill_tokens + (tokens_pad if prefill_lens else 0),
        padded_prefill_seqs=exact_mode.padded_prefill_seqs + (pseq_pad if prefill_lens else 0),
        padded_decode_seqs=exact_mode.padded_decode_seqs + (dseq_pad if decode_ctx else 0),
        block_table_width=exact_mode.block_table_width + width_pad,
    )
    padded_mode = dataclasses.replace(
        padded_mode, padded_num_logits=padded_mode.padded_prefill_seqs + padded_mode.padded_decode_seqs
    )
    batch = mf.build_batch(plan, padded_mode, block_size=BLOCK_SIZE, device="cpu")
    if batch.prefill is not None:
        cu = batch.prefill.cu_seqlens_q.tolist()
        assert cu[len(prefill_lens):] == [cu[len(prefill_lens)]] * (len(cu) - len(prefill_lens))
    padded_rows = batch.slot_mapping < 0
    assert int(padded_rows.sum()) == padded_mode.num_tokens - exact_mode.num_tokens
    logits, padded_state = mf.forward(model.params, state, batch, padded_mode, copy=True)
    n = exact_mode.num_logits
    assert rel_err(logits[:n], exact_logits[:n]) <= 1e-12
    for exact_cache, padded_cache in zip(exact_state.leaves(), padded_state.leaves()):
        # block 0 is scratch; elsewhere only matmul blocking over more rows may differ
        torch.testing.assert_close(padded_cache[1:], exact_cache[1:], rtol=1e-12, atol=1e-12)


def test_forward_is_differentiable_under_torch_func(model):
    """The pure forward composes with torch.func.grad over the params pytree (copy=True)."""
    params = model.params
    leaves, spec = mf.pytree.tree_flatten(params)
    tokens = [5, 9, 2, 7, 7, 1]

    def loss(leaves):
        p = mf.pytree.tree_unflatten(spec, leaves)
        state = fresh_state(model)
        plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens[:-1]), 0, (1, 2), 5),))
        batch, mode = mf.plan_step(model.config, state, plan)
        logits, _ = mf.forward(p, state, batch, mode, copy=True)
        return torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:]))

    grads = torch.func.grad(loss)(leaves)
    by_id = {id(leaf): g for leaf, g in zip(leaves, grads)}
    assert by_id[id(params.embed)].abs().sum() > 0
    w_uk = params.layers[0].attn.w_uk
    assert by_id[id(w_uk)].abs().sum() > 0
    # finite-difference check of one weight entry
    eps = 1e-6
    bumped = [leaf.clone() if leaf is w_uk else leaf for leaf in leaves]
    bumped[[i for i, leaf in enumerate(leaves) if leaf is w_uk][0]][0, 0, 0] += eps
    numeric = (loss(bumped) - loss(leaves)) / eps
    torch.testing.assert_close(numeric, by_id[id(w_uk)][0, 0, 0], rtol=1e-4, atol=1e-7)


def test_an_explicit_op_table_records_the_experts_chosen(model):
    from mla_func.kernels import ops_for, record_expert_choice

    state = fresh_state(model)
    plan = mf.StepPlan(prefill=(mf.SeqPlan((3, 4, 5), 0, blocks(0, 8), 1),))
    padding = mf.PaddingPolicy(prefill_tokens=(8,), prefill_seqs=(2,), block_table_widths=(4,))
    mode = mf.ForwardMode.decide(plan, cache_groups=state.groups, padding=padding)
    batch = mf.build_batch(plan, mode, block_size=BLOCK_SIZE, device="cpu")
    ops, chosen = record_expert_choice(ops_for("torch"))
    logits, _ = mf.forward(model.params, state, batch, mode, copy=True, ops=ops)
    plain, _ = mf.forward(model.params, state, batch, mode, copy=True)
    assert torch.equal(logits, plain)
    moe_layers = sum(isinstance(layer.mlp, MoEParams) for layer in model.params.layers)
    assert len(chosen) == moe_layers
    k = model.config.num_experts_per_tok
    for ids in chosen:
        assert ids.shape == (8, k)
        assert bool((ids[:3] >= 0).all()) and bool((ids[3:] == -1).all())  # padded rows take no expert
    with pytest.raises(ValueError, match="ops are for backend 'triton'"):
        mf.forward(model.params, state, batch, mode, copy=True, ops=ops_for("triton"))
