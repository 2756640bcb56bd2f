"""Draft and verify steps on the GPU: graph == eager, no host sync inside a replay, engine tokens unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mla_func as mf
from support.hand_plans import blocks
from mla_func.models.mtp.layer import DrafterFn, drafter_params, init_drafter_state, mtp_layer, target_step_fn

pytestmark = pytest.mark.gpu

LADDER = mf.PaddingPolicy(decode_seqs=(1, 2, 4, 8), prefill_tokens=(16, 32, 64), prefill_seqs=(1, 2, 4),
                          block_table_widths=(4, 8, 16))
BLOCK_SIZE = 4
PER_SEQ = 20
BACKENDS = ["torch", "triton"]


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", mtp=True, dtype=torch.float32, device="cuda", seed=9)


def _steps(model, backend, drafter: bool, graphs: bool):
    if drafter:
        return mf.make_step(model, fn=DrafterFn(mtp_layer(model.config)), params=drafter_params(model),
                            backend=backend, padding=LADDER, graphs=graphs)
    return mf.make_step(model, fn=target_step_fn, backend=backend, padding=LADDER, graphs=graphs)


def _state(model, drafter: bool, contexts):
    """A target (or drafter) state where sequence i holds contexts[i] tokens."""
    state = mf.init_state(model, num_blocks=256, block_size=BLOCK_SIZE)
    plan = mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple((3 * i + k) % 500 for k in range(n)), 0, blocks(i, PER_SEQ), 0)
                                     for i, n in enumerate(contexts)))
    batch, mode = mf.plan_step(model.config, state, plan)
    if not drafter:
        return mf.forward(model.params, state, batch, mode)[1]
    dstate = init_drafter_state(model, state)
    hidden = torch.randn(mode.num_tokens, model.config.hidden_size, device="cuda", generator=_gen(1))
    _, dstate = mf.forward_outputs(drafter_params(model), dstate, replace(batch, hidden=hidden), mode,
                                   layers=(mtp_layer(model.config),))
    return dstate


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _plan(contexts, q):
    return mf.StepPlan(decode=tuple(mf.SeqPlan(tuple(range(5 + i, 5 + i + q)), n, blocks(i, PER_SEQ), q)
                                    for i, n in enumerate(contexts)), decode_q_len=q)


def _prepared(step, state, plan, drafter: bool, seed):
    batch, mode = step.prepare(state, plan)
    if drafter:
        batch = replace(batch, hidden=torch.randn(mode.num_tokens, step.config.hidden_size, device="cuda",
                                                  generator=_gen(seed)))
    return batch, mode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("drafter", [False, True], ids=["verify", "draft"])
@pytest.mark.parametrize("q", [1, 2, 4])
def test_graph_equals_eager(model, backend, drafter, q):
    contexts = [5, 13, 2]
    graph, eager = _steps(model, backend, drafter, True), _steps(model, backend, drafter, False)
    g_state, e_state = _state(model, drafter, contexts), _state(model, drafter, contexts)
    plan = _plan(contexts, q)
    g_batch, g_mode = _prepared(graph, g_state, plan, drafter, seed=q)
    e_batch, e_mode = eager.prepare(e_state, plan)
    e_batch = replace(e_batch, hidden=None if g_batch.hidden is None else g_batch.hidden[: e_mode.num_tokens])
    g_state, g_out = graph(g_state, g_batch, g_mode)
    e_state, e_out = eager(e_state, e_batch, e_mode)
    assert g_mode.use_graph and g_out.graph and g_mode.decode_q_len == q
    torch.testing.assert_close(g_out.output.logits, e_out.output.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_out.output.hidden, e_out.output.hidden, rtol=1e-5, atol=1e-5)
    for g, e in zip(g_state.leaves(), e_state.leaves()):
        torch.testing.assert_close(g[1:], e[1:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_inside_draft_and_verify_steps(model, backend):
    contexts = [4, 9]
    prepared = []
    for drafter in (False, True):
        step = _steps(model, backend, drafter, True)
        state = _state(model, drafter, contexts)
        for q in (1, 3):
            batch, mode = _prepared(step, state, _plan(contexts, q), drafter, seed=q)
            state, _ = step(state, batch, mode)   # capture first: capture itself synchronises by design
            prepared.append((step, state, *_prepared(step, state, _plan(contexts, q), drafter, seed=q)))
            state = prepared[-1][1]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, state, batch, mode in prepared:
            _, out = step(state.renewed(), batch, mode)
            assert out.graph
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("k", [1, 3])
def test_engine_tokens_with_graphs_equal_plain_decoding(model, k):
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 17, [1]]
    params = mf.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = mf.Engine(model, block_size=BLOCK_SIZE, num_blocks=128, graphs=False).generate(prompts, params)
    engine = mf.Engine(model, block_size=BLOCK_SIZE, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
                       speculative_tokens=k)
    got = engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert any(key[4] == k + 1 for key in engine.step.captured_keys)            # verify steps replayed
    assert engine.speculative_stats.drafted > 0


def test_engine_warmup_captures_every_verify_and_drafter_graph(model):
    """After `warmup`, generating captures no graph: every verify length 1..k+1 and the drafter's
    draft / catch-up lengths were captured up front (with zero hidden states for the drafter)."""
    k = 2
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 17]
    params = mf.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = mf.Engine(model, block_size=BLOCK_SIZE, num_blocks=128, graphs=False).generate(prompts, params)
    engine = mf.Engine(model, block_size=BLOCK_SIZE, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
                       speculative_tokens=k)
    per_length = len(engine.step.decode_graph_modes(engine.state))
    assert engine.warmup(progress=False) == 2 * (k + 1) * per_length   # target and drafter, lengths 1..k+1
    target_keys = set(engine.step.captured_keys)
    assert {key[4] for key in target_keys} == {1, 2, 3}
    got = engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert set(engine.step.captured_keys) == target_keys
    assert engine.warmup(progress=False) == 0
