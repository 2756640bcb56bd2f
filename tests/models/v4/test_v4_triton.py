"""The whole `v4-tiny` model on the Triton op table (Triton's interpreter without a GPU) = the torch table.

One run of prefill, a mixed step and decode steps, with padded rows (the steps are
padded to ladders), sequences in different layer-state phases, and the window and
compression boundaries crossed, on both tables from the same weights.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf

from support.v4_reference import Seq, new_state, relative_error

PADDING = mf.PaddingPolicy(decode_seqs=(4,), prefill_tokens=(24,), prefill_seqs=(2,))


@pytest.fixture(scope="module")
def tiny():
    # Triton's interpreter runs the kernels on CPU tensors; a CUDA machine runs them compiled, on the GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return mf.load_model("v4-tiny", dtype=torch.float32, device=device, seed=1)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: mf.Model, backend: str) -> list[torch.Tensor]:
    state = new_state(model)
    seqs = [Seq(i, state.groups) for i in range(3)]
    first, second = _tokens(0, 21), _tokens(1, 10)
    plans = [
        # 21 tokens: the window (8) slides, five CSA blocks (4) and an HCA block (16) complete.
        mf.StepPlan(prefill=(seqs[0].plan(first, 0),)),
        # Mixed: a new prompt beside the first sequence's first decode step.
        mf.StepPlan(prefill=(seqs[1].plan(second, 0),), decode=(seqs[0].plan([5], 21, 1),)),
    ]
    lens = [22, 10, 0]
    for step in range(3):
        # The third sequence joins with a one-token prompt: a window of one, no entry yet.
        decode = [seqs[i].plan([7 + step + i], lens[i], 1) for i in (0, 1)]
        prefill = (seqs[2].plan([9], 0),) if step == 0 else ()
        if step > 0:
            decode.append(seqs[2].plan([11 + step], lens[2], 1))
        plans.append(mf.StepPlan(prefill=prefill, decode=tuple(decode)))
        lens = [n + 1 for n in lens]
    outputs = []
    for plan in plans:
        batch, mode = mf.plan_step(model.config, state, plan, backend=backend, padding=PADDING)
        logits, state = mf.forward(model.params, state, batch, mode)
        outputs.append(logits[: mode.num_logits])
    return outputs


def test_v4_tiny_on_the_triton_table_equals_torch(tiny):
    ops = mf.kernels.ops_for("triton")
    assert ops.v4.window_entry_attention.__module__.endswith("triton.v4_attention")
    assert ops.v4.compress_entries.__module__.endswith("triton.v4_compress")
    want = _run(tiny, "torch")
    got = _run(tiny, "triton")
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert relative_error(g, w) <= 1e-5
        assert torch.equal(g.argmax(-1), w.argmax(-1)), "greedy tokens differ"
