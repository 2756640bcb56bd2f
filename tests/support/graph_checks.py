"""Graph steps against eager steps of the same padding, on hand-made plans (GPU tests)."""

from __future__ import annotations

import dataclasses

import torch

import mla_func as mf
from support.hand_plans import blocks


LADDER = mf.PaddingPolicy(decode_seqs=(1, 2, 4, 8), prefill_tokens=(16, 32, 64), prefill_seqs=(1, 2, 4),
                          block_table_widths=(4, 8, 16))
BLOCK_SIZE = 4
PER_SEQ = 20  # blocks a test sequence owns: 80 positions
BACKENDS = ["torch", "triton"]


def fresh_state(model):
    return mf.init_state(model.config, num_blocks=256, block_size=BLOCK_SIZE, dtype=model.dtype, device="cuda")


def clone_state(state):
    return mf.pytree.tree_map(torch.clone, state)


def with_context(model, contexts):
    """A state where sequence i holds contexts[i] tokens (written eagerly)."""
    state = fresh_state(model)
    seqs = tuple(mf.SeqPlan(tuple((5 * i + k) % 500 for k in range(n)), 0, blocks(i, PER_SEQ), 0) for i, n in enumerate(contexts) if n)
    if seqs:
        batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=seqs))
        _, state = mf.forward(model.params, state, batch, mode)
    return state


def decode_plan(contexts):
    return mf.StepPlan(decode=tuple(mf.SeqPlan((7 + i,), n, blocks(i, PER_SEQ)) for i, n in enumerate(contexts)))


def prefill_plan(lengths, offset=0):
    return mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple(range(3, 3 + n)), 0, blocks(offset + i, PER_SEQ)) for i, n in enumerate(lengths)))


def compare(model, backend, state, plan, *, padding=LADDER, exact=False):
    """Run `plan` through a graph step and an eager step with the same padding; compare everything:
    logits and every cache block but the scratch block 0, bit for bit with `exact`, else to 1e-5."""
    graph_step = mf.make_step(model, backend=backend, padding=padding)
    eager_step = mf.make_step(model, backend=backend, padding=padding, graphs=False)
    g_state, e_state = clone_state(state), clone_state(state)
    g_batch, g_mode = graph_step.prepare(g_state, plan)
    e_batch, e_mode = eager_step.prepare(e_state, plan)
    # The graph step falls back to eager exactly when the step is above its ladders.
    assert g_mode.graph_fallback is (not g_mode.use_graph) and not e_mode.graph_fallback
    assert dataclasses.replace(g_mode, use_graph=False, graph_fallback=False) == e_mode
    g_state, g_out = graph_step(g_state, g_batch, g_mode)
    # Replay once more from the same starting contents, in the buffers the graph writes:
    # the replay path, not only the capture's warm-up.
    for dst, src in zip(g_state.leaves(), state.leaves()):
        dst.copy_(src)
    again_batch, again_mode = graph_step.prepare(g_state, plan)
    again_state, again_out = graph_step(g_state, again_batch, again_mode)
    e_state, e_out = eager_step(e_state, e_batch, e_mode)
    torch.cuda.synchronize()
    if g_mode.use_graph:
        assert g_out.graph and again_out.graph
    logits_tol, cache_tol = (0.0, 0.0) if exact else (1e-5, 1e-6)
    for out in (g_out, again_out):
        torch.testing.assert_close(out.logits, e_out.logits, rtol=logits_tol, atol=logits_tol)
    for g_cache, e_cache in zip(again_state.leaves(), e_state.leaves()):
        torch.testing.assert_close(g_cache[1:], e_cache[1:], rtol=cache_tol, atol=cache_tol)  # block 0 is scratch
    return g_mode


def run_without_host_sync(step, state, plans):
    """Capture each plan's graph (capture synchronises by design), then replay every plan with CUDA's sync
    debug mode set to "error", so any host sync inside a step raises. Returns (the state before the last
    replay, the last state, the last prepared (batch, mode)): the first is donated by then."""
    prepared = []
    for plan in plans:
        batch, mode = step.prepare(state, plan)
        state, _ = step(state, batch, mode)
        prepared.append(step.prepare(state, plan))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch, mode in prepared:
            new_state, out = step(state, batch, mode)
            assert out.graph
            stale, state = state, new_state
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return stale, state, prepared[-1]
