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


def compare(model, backend, state, plan):
    """Run `plan` through a graph step and an eager step with the same padding; compare everything."""
    graph_step = mf.make_step(model, backend=backend, padding=LADDER)
    eager_step = mf.make_step(model, backend=backend, padding=LADDER, graphs=False)
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
    for out in (g_out, again_out):
        torch.testing.assert_close(out.logits, e_out.logits, rtol=1e-5, atol=1e-5)
    for g_cache, e_cache in zip(again_state.leaves(), e_state.leaves()):
        torch.testing.assert_close(g_cache[1:], e_cache[1:], rtol=1e-6, atol=1e-6)  # block 0 is scratch
    return g_mode
