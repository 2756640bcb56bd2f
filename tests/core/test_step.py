"""make_step: the memoized step equals the forward; ladders; misuse raises. (CUDA graphs: test_step_gpu.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mla_func as mf
from support.hand_plans import blocks
from mla_func.core.step import padding_ladders


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=4)


def fresh_state(model):
    return mf.init_state(model.config, num_blocks=64, block_size=4, dtype=model.dtype)


def plan_of(lengths, start=0):
    return mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple(range(2, 2 + n)), start, blocks(i, 6)) for i, n in enumerate(lengths)))


def test_step_equals_forward_and_donates(model):
    step = mf.make_step(model)
    assert not step.graphs and step.backend == "torch"
    plan = plan_of([5, 3])
    state = fresh_state(model)
    batch, mode = step.prepare(state, plan)
    want, _ = mf.forward(model.params, fresh_state(model), *mf.plan_step(model.config, fresh_state(model), plan))
    new_state, out = step(state, batch, mode)
    assert torch.equal(out.logits, want) and out.logits.shape[0] == mode.num_logits and not out.graph
    with pytest.raises(mf.DonatedStateError):
        step(state, batch, mode)
    assert not new_state.is_donated


def test_padded_step_equals_exact_step(model):
    ladder = mf.PaddingPolicy(decode_seqs=(2, 4), prefill_tokens=(16, 32), prefill_seqs=(4,), block_table_widths=(8,))
    plan = plan_of([5, 3, 6])
    exact_step, padded_step = mf.make_step(model), mf.make_step(model, padding=ladder)
    batch, mode = padded_step.prepare(fresh_state(model), plan)
    assert (mode.padded_prefill_tokens, mode.padded_prefill_seqs, mode.block_table_width) == (16, 4, 8)
    _, padded = padded_step(fresh_state(model), batch, mode)
    _, exact = exact_step(fresh_state(model), *exact_step.prepare(fresh_state(model), plan))
    torch.testing.assert_close(padded.logits, exact.logits, rtol=1e-12, atol=1e-12)


def test_a_mode_from_another_backend_is_refused(model):
    step = mf.make_step(model)
    state = fresh_state(model)
    batch, mode = mf.plan_step(model.config, state, plan_of([2]), backend="triton")
    with pytest.raises(ValueError, match="decided for backend 'triton'"):
        step(state, batch, mode)


def test_default_ladders():
    p = padding_ladders(max_num_seqs=100, max_num_batched_tokens=3000, max_blocks_per_seq=40)
    assert p.decode_seqs[:5] == (1, 2, 4, 8, 16) and p.decode_seqs[-1] == 100
    steps = [b - a for a, b in zip(p.decode_seqs, p.decode_seqs[1:])]
    assert all(s in (8, 16) for s in steps[3:-1])
    assert p.prefill_tokens == (16, 32, 64, 128, 256, 512, 1024, 2048, 3000)
    assert p.block_table_widths[-1] == 40 and p.prefill_seqs[-1] == 100


def test_ladders_use_the_full_table_width_while_it_is_small():
    small = padding_ladders(max_num_seqs=256, max_num_batched_tokens=8192, max_blocks_per_seq=21)
    assert small.block_table_widths == (21,)
    large = padding_ladders(max_num_seqs=64, max_num_batched_tokens=2048, max_blocks_per_seq=10240)
    assert large.block_table_widths == tuple(2**i for i in range(14)) + (10240,)


def test_decode_graph_modes_are_empty_without_graphs(model):
    assert mf.make_step(model, backend="torch").decode_graph_modes() == ()


def test_an_all_padding_batch_runs_and_writes_only_the_scratch_block(model):
    """What `Step.warmup` captures with: a batch of nothing but padded rows."""
    ladder = mf.PaddingPolicy(decode_seqs=(4,), prefill_tokens=(16,), prefill_seqs=(2,), block_table_widths=(4,))
    state = fresh_state(model)
    for cache in state.leaves():
        cache.normal_()
    before = [c.clone() for c in state.leaves()]
    mode = mf.ForwardMode.decide(
        mf.StepPlan(prefill=(mf.SeqPlan((1, 2), 0, (1,)),), decode=(mf.SeqPlan((3,), 2, (2,)),)),
        cache_groups=state.groups, padding=ladder,
    )
    empty = dataclasses.replace(mode, num_prefill_tokens=0, num_prefill_seqs=0, num_decode_seqs=0, num_logits=0)
    batch = mf.build_batch(mf.StepPlan(), empty, block_size=4, device="cpu")
    assert bool((batch.slot_mapping == -1).all()) and empty.num_tokens == 20
    logits, new_state = mf.forward(model.params, state, batch, empty)
    assert logits.shape == (6, model.config.vocab_size) and logits.isfinite().all()
    for old, new in zip(before, new_state.leaves()):
        assert torch.equal(old[1:], new[1:])


def test_make_step_memoizes_any_pure_step_function(model):
    """A function other than the model's forward: each logits row's embedding, scaled; the state passes through."""

    def embed_rows(params, state, batch, mode):
        rows = batch.input_ids[batch.logits_indices]
        return mf.ForwardOutput(logits=params["scale"] * params["table"][rows]), state

    table = torch.randn(model.config.vocab_size, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    step = mf.make_step(model, fn=embed_rows, params={"scale": torch.tensor(2.0, dtype=torch.float64), "table": table})
    state = fresh_state(model)
    plan = plan_of([3, 2])
    batch, mode = step.prepare(state, plan)
    new_state, out = step(state, batch, mode)
    want = 2.0 * table[[plan.prefill[0].token_ids[-1], plan.prefill[1].token_ids[-1]]]
    assert torch.equal(out.logits, want) and out.logits.shape == (mode.num_logits, 6)
    assert new_state is state  # the function returned its state as it was


def test_warmup_modes_have_the_keys_real_decode_steps_get(model):
    """`decode_graph_modes` builds its modes with the constructor `decide` uses: the same static keys."""
    ladder = mf.PaddingPolicy(decode_seqs=(1, 2, 4), prefill_tokens=(16,), prefill_seqs=(2,), block_table_widths=(8,))
    step = mf.Step(fn=lambda *a: a, params=model.params, config=model.config, backend="torch", graphs=True,
                   padding=ladder, block_size=4, graph_kinds=("decode",))
    state = fresh_state(model)
    warm = {m.static_key for m in step.decode_graph_modes(state)}
    assert len(warm) == 3
    for n in (1, 2, 3, 4):
        plan = mf.StepPlan(decode=tuple(mf.SeqPlan((5,), 3 + i, blocks(i, 6)) for i in range(n)))
        _, mode = step.prepare(state, plan)
        assert mode.use_graph and mode.static_key in warm and not mode.gather_logits
    # A step that asked for a graph but did not fit is marked so; one of a kind without graphs is not.
    big = mf.StepPlan(decode=tuple(mf.SeqPlan((5,), 3, blocks(i, 6)) for i in range(5)))
    assert step.prepare(state, big)[1].graph_fallback
    assert not step.prepare(state, plan_of([3]))[1].graph_fallback
