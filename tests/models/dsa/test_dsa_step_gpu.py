"""DeepSeek-V3.2 under CUDA graphs: graph == eager on every captured decode key, and no host sync in a step."""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.hand_plans import blocks
from support.dsa_reference import make_v32
from support.graph_checks import BACKENDS, LADDER, PER_SEQ, compare, run_without_host_sync

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32-gpu")
    make_v32("v32", seed=3).save_pretrained(path)
    return mf.load_model(path, dtype=torch.float32, device="cuda")


def with_context(model, contexts):
    """A state where sequence i holds contexts[i] tokens (index_topk is 8: most contexts are sparse)."""
    state = mf.init_state(model, num_blocks=256, block_size=BLOCK_SIZE)
    seqs = tuple(mf.SeqPlan(tuple((5 * i + k) % 97 for k in range(n)), 0, blocks(i, PER_SEQ), 0)
                 for i, n in enumerate(contexts))
    batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=seqs))
    _, state = mf.forward(model.params, state, batch, mode)
    return state


def decode_plan(contexts):
    return mf.StepPlan(decode=tuple(mf.SeqPlan((7 + i,), n, blocks(i, PER_SEQ)) for i, n in enumerate(contexts)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 7, 8, 9])
def test_decode_graph_equals_eager(model, backend, num_seqs):
    contexts = [3 + 8 * i for i in range(num_seqs)]  # the longest (60 tokens) fits the widest rung
    mode = compare(model, backend, with_context(model, contexts), decode_plan(contexts))
    assert mode.use_graph == (num_seqs <= 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_graph_equals_eager(model, backend):
    state = with_context(model, [30, 12])
    prefill = tuple(mf.SeqPlan(tuple(range(3, 3 + n)), 0, blocks(2 + i, PER_SEQ)) for i, n in enumerate([20, 9]))
    mode = compare(model, backend, state, mf.StepPlan(prefill=prefill, decode=decode_plan([30, 12]).decode))
    assert mode.kind == "mixed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_inside_a_step(model, backend):
    step = mf.make_step(model, backend=backend, padding=LADDER)
    contexts = [14, 29]
    state = with_context(model, contexts)
    plans = [decode_plan(contexts), decode_plan([15, 30])]
    run_without_host_sync(step, state, plans)
