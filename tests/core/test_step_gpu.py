"""CUDA graphs as memoization: graph == eager on every key, padded sizes and the eager fallback."""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.hand_plans import blocks
from support.graph_checks import (BACKENDS, BLOCK_SIZE, LADDER, PER_SEQ, clone_state, compare, decode_plan, fresh_state,
                                  prefill_plan, run_without_host_sync, with_context)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", dtype=torch.float32, device="cuda", seed=7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 7, 8, 9])
def test_decode_graph_equals_eager(model, backend, num_seqs):
    contexts = [3 + 5 * i for i in range(num_seqs)]
    mode = compare(model, backend, with_context(model, contexts), decode_plan(contexts))
    assert mode.use_graph == (num_seqs <= 8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [2, 4])
@pytest.mark.parametrize("num_seqs", [1, 3, 9])
def test_verify_graph_equals_eager(model, backend, q_len, num_seqs):
    """Decode rows of several query tokens (verify rows) replay as graphs like any decode step."""
    contexts = [3 + 5 * i for i in range(num_seqs)]
    plan = mf.StepPlan(decode=tuple(mf.SeqPlan(tuple(7 + i + j for j in range(q_len)), n, blocks(i, PER_SEQ), q_len)
                                    for i, n in enumerate(contexts)), decode_q_len=q_len)
    mode = compare(model, backend, with_context(model, contexts), plan)
    assert mode.use_graph == (num_seqs <= 8) and mode.decode_q_len == q_len


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [[16], [15], [9, 6], [32], [31, 1, 1], [20, 20, 20, 4], [40, 40]])
def test_prefill_graph_equals_eager(model, backend, lengths):
    mode = compare(model, backend, fresh_state(model), prefill_plan(lengths))
    assert mode.use_graph == (sum(lengths) <= 64 and len(lengths) <= 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths, contexts", [([5], [9]), ([16], [3, 4]), ([11, 4], [8, 8, 8]), ([60, 10], [2])])
def test_mixed_graph_equals_eager(model, backend, lengths, contexts):
    state = with_context(model, contexts)
    decode = decode_plan(contexts).decode
    prefill = prefill_plan(lengths, offset=len(contexts)).prefill
    mode = compare(model, backend, state, mf.StepPlan(prefill=prefill, decode=decode))
    assert mode.kind == "mixed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_graph_and_eager_agree_for_64_steps(model, backend):
    prompts = [[11, 12, 13, 14, 15], [200, 3, 99], [42]]

    def generate(graphs):
        step = mf.make_step(model, backend=backend, padding=mf.PaddingPolicy(
            decode_seqs=(1, 2, 4), prefill_tokens=(16,), prefill_seqs=(4,), block_table_widths=(8, 16, 32)), graphs=graphs)
        state = fresh_state(model)
        plan = mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple(p), 0, blocks(i, 24)) for i, p in enumerate(prompts)))
        state, out = step(state, *step.prepare(state, plan))
        tokens = [[int(t)] for t in out.logits.argmax(-1)]
        for _ in range(63):
            plan = mf.StepPlan(decode=tuple(
                mf.SeqPlan((toks[-1],), len(p) + len(toks) - 1, blocks(i, 24)) for i, (p, toks) in enumerate(zip(prompts, tokens))
            ))
            state, out = step(state, *step.prepare(state, plan))
            for toks, t in zip(tokens, out.logits.argmax(-1).tolist()):
                toks.append(t)
        return tokens, step

    graph_tokens, graph_step = generate(True)
    eager_tokens, _ = generate(False)
    assert graph_tokens == eager_tokens
    assert len(graph_step.captured_keys) >= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_inside_a_step(model, backend):
    step = mf.make_step(model, backend=backend, padding=LADDER)
    contexts = [4, 9]
    state = with_context(model, contexts)
    plans = [decode_plan(contexts), prefill_plan([7, 5], offset=2),
             mf.StepPlan(prefill=prefill_plan([6], offset=4).prefill, decode=decode_plan([5, 10]).decode)]
    run_without_host_sync(step, state, plans)


def test_stale_state_raises_and_capture_errors_reach_the_caller(model):
    from mla_func.core.step import model_step_fn

    failing = {"on": True}

    def fn(*args):
        if failing["on"] and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("injected capture failure")
        return model_step_fn(*args)

    step = mf.make_step(model, backend="torch", padding=LADDER, fn=fn)
    state = with_context(model, [4])
    batch, mode = step.prepare(state, decode_plan([4]))
    with pytest.raises(RuntimeError, match="injected capture failure"):
        step(state, batch, mode)
    assert step.captured_keys == ()  # nothing half-registered
    failing["on"] = False
    new_state, out = step(state, batch, mode)
    assert out.graph and step.captured_keys == (mode.static_key,)
    with pytest.raises(mf.DonatedStateError):
        step(state, batch, mode)


def test_warmup_captures_largest_first_and_later_steps_replay(model):
    step = mf.make_step(model, backend="triton", padding=LADDER)
    state = with_context(model, [5, 6, 7])
    modes = [
        mf.ForwardMode.decide(decode_plan([5] * n), cache_groups=state.groups, backend="triton", padding=LADDER,
                              graphs=True)
        for n in (1, 2, 4, 8)
    ]
    before = [c.clone() for c in state.leaves()]
    step.warmup(state, modes)
    assert [key[3] for key in step.captured_keys] == [8, 4, 2, 1]  # largest first
    for old, new in zip(before, state.leaves()):
        torch.testing.assert_close(new[1:], old[1:], rtol=0, atol=0)  # padding writes only scratch
    plan = decode_plan([5, 6, 7])
    eager = mf.make_step(model, backend="triton", padding=LADDER, graphs=False)
    e_state = clone_state(state)
    _, e_out = eager(e_state, *eager.prepare(e_state, plan))
    state, out = step(state, *step.prepare(state, plan))
    assert out.graph and len(step.captured_keys) == 4
    torch.testing.assert_close(out.logits, e_out.logits, rtol=1e-5, atol=1e-5)


def test_engine_warmup_captures_every_decode_graph_a_run_needs(model):
    engine = mf.Engine(model, block_size=BLOCK_SIZE, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                       max_model_len=64)
    modes = engine.step.decode_graph_modes()
    # 8 sequences x 16 blocks fit one full-width table: one graph a batch rung.
    assert {m.block_table_width for m in modes} == {16}
    assert engine.warmup(progress=False) == len(modes) == len(engine.step.padding.decode_seqs)
    prompts = [[(3 * i + k) % 500 for k in range(5 + 3 * i)] for i in range(7)]
    params = mf.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    warm = engine.generate(prompts, params)
    assert len(engine.step.captured_keys) == len(modes)  # nothing captured while generating
    eager = mf.Engine(model, block_size=BLOCK_SIZE, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=64, graphs=False).generate(prompts, params)
    assert [c.token_ids for c in warm] == [c.token_ids for c in eager]
