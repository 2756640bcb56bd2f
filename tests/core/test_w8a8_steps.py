"""w8a8 steps: `make_step(w8a8=True)` / `Engine(w8a8=True)` decide every mode with `ForwardMode.w8a8`, whose
default op table quantizes FP8 products' activations (`ops_for(backend, w8a8=True)`); the math is the w8a8
tables' (`kernels.reference.w8a8`), the same function with another table, refused where it cannot apply.
(The Triton w8a8 table against the reference's: tests/kernels/test_fp8_table.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mla_func as mf
from mla_func.kernels import ops_for
from mla_func.kernels.reference.w8a8 import w8a8_ops as reference_w8a8_ops
from mla_func.parallel.data_parallel import rank_modes
from support.hand_plans import blocks

PROMPT = tuple(range(5, 18))


@pytest.fixture(scope="module")
def fp8_model():
    return mf.load_model("tiny", dtype=torch.float32, device="cpu", seed=5, quantization="fp8")


def _plans():
    """A 13-token prompt, then two decode steps."""
    table = blocks(0, 6)
    plans = [mf.StepPlan(prefill=(mf.SeqPlan(PROMPT, 0, table, len(PROMPT)),))]
    return plans + [mf.StepPlan(decode=(mf.SeqPlan((40 + i,), len(PROMPT) + i, table, 1),)) for i in range(2)]


def _prefill_then_decode(step, model):
    """Logits of `_plans` through `step` (prepare + call), [15, V] float64."""
    state = mf.init_state(model, num_blocks=8, block_size=4)
    rows = []
    for plan in _plans():
        batch, mode = step.prepare(state, plan)
        assert mode.w8a8 == step.w8a8
        state, out = step(state, batch, mode)
        rows.append(out.logits)
    return torch.cat(rows).double()


def _with_table(model, ops):
    """`_plans` through the forward with an explicit table (modes decided for it)."""
    state = mf.init_state(model, num_blocks=8, block_size=4)
    rows = []
    for plan in _plans():
        batch, mode = mf.plan_step(model.config, state, plan, backend="torch", w8a8=ops.w8a8)
        out, state = mf.forward(model.params, state, batch, mode, ops=ops)
        rows.append(out[: mode.num_logits])
    return torch.cat(rows).double()


def test_a_w8a8_step_runs_the_w8a8_table(fp8_model):
    w8a8 = _prefill_then_decode(mf.make_step(fp8_model, w8a8=True), fp8_model)
    plain = _prefill_then_decode(mf.make_step(fp8_model), fp8_model)
    assert torch.equal(w8a8, _with_table(fp8_model, reference_w8a8_ops(ops_for("torch"))))
    assert torch.equal(plain, _with_table(fp8_model, ops_for("torch")))
    # Quantized activations move this random toy's logits by percents (test_fp8_table.py): the switch is live.
    assert float((w8a8 - plain).norm() / plain.norm()) > 0.01


def test_the_table_follows_the_mode():
    assert ops_for("torch", w8a8=True).w8a8 and not ops_for("torch").w8a8
    assert ops_for("torch", w8a8=True).dense.linear is not ops_for("torch").dense.linear
    with pytest.raises(ValueError, match="batch_invariant=True and w8a8=True"):
        ops_for("torch", batch_invariant=True, w8a8=True)
    with pytest.raises(ValueError, match="backend 'aiter' has no w8a8 op table"):
        ops_for("aiter", w8a8=True)


def test_a_mode_and_a_table_that_disagree_are_refused(fp8_model):
    state = mf.init_state(fp8_model, num_blocks=8, block_size=4)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(PROMPT, 0, blocks(0, 6), len(PROMPT)),))
    batch, mode = mf.plan_step(fp8_model.config, state, plan, w8a8=True)
    assert mode.static_key != dataclasses.replace(mode, w8a8=False).static_key   # graphs memoized apart
    with pytest.raises(ValueError, match=r"ops do not quantize .* the mode does"):
        mf.forward(fp8_model.params, state, batch, mode, ops=ops_for("torch"))
    with pytest.raises(ValueError, match=r"ops quantize .* the mode does not"):
        mf.forward(fp8_model.params, state, batch, dataclasses.replace(mode, w8a8=False),
                   ops=ops_for("torch", w8a8=True))


def test_the_engine_scores_and_generates_with_w8a8(fp8_model):
    engine = mf.Engine(fp8_model, w8a8=True, max_model_len=64, num_blocks=16)
    scored = engine.score(list(PROMPT)).double()
    assert torch.equal(scored, _with_table(fp8_model, reference_w8a8_ops(ops_for("torch")))[: len(PROMPT)])
    out = engine.generate([list(PROMPT)], mf.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_w8a8_is_refused_where_it_cannot_apply(fp8_model):
    plain = mf.load_model("tiny", dtype=torch.float32, device="cpu", seed=5)
    assert fp8_model.has_fp8_weights and not plain.has_fp8_weights
    with pytest.raises(ValueError, match="Engine: w8a8=True .* this model has no FP8 weights"):
        mf.Engine(plain, w8a8=True, max_model_len=64, num_blocks=16)
    with pytest.raises(ValueError, match="make_step: w8a8=True .* this model has no FP8 weights"):
        mf.make_step(plain, w8a8=True)
    with pytest.raises(ValueError, match="Engine: w8a8=True with batch_invariant=True"):
        mf.Engine(fp8_model, w8a8=True, batch_invariant=True, max_model_len=64, num_blocks=16)
    with pytest.raises(ValueError, match="Engine: w8a8 must be a bool"):
        mf.Engine(fp8_model, w8a8="yes", max_model_len=64, num_blocks=16)


def test_an_idle_data_parallel_rank_runs_the_busy_ranks_table(fp8_model):
    """The blocks ranks share (the MLP, the experts) run one table on every rank: an idle rank's mode
    carries the busy ranks' w8a8."""
    state = mf.init_state(fp8_model, num_blocks=8, block_size=4)
    busy = mf.StepPlan(decode=(mf.SeqPlan((7,), 3, blocks(0, 2), 1),))
    modes = rank_modes([busy, mf.StepPlan()], cache_groups=state.groups, backend="torch", w8a8=True)
    assert [m.w8a8 for m in modes] == [True, True] and modes[1].num_decode_seqs == 0
