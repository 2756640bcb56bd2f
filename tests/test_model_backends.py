"""The whole model on the Triton backend against the torch reference (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from driver import blocks
from reference_models import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_plan(model, backend, plans, block_size):
    state = mf.init_state(model.config, num_blocks=64, block_size=block_size, dtype=model.dtype, device=DEVICE)
    outs = []
    for plan in plans:
        batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
        logits, state = mf.forward(model.params, state, batch, mode)
        outs.append(logits[: mode.num_logits])
    return torch.cat(outs)


def greedy(model, backend, prompts, steps, block_size):
    state = mf.init_state(model.config, num_blocks=64, block_size=block_size, dtype=model.dtype, device=DEVICE)
    plan = mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple(p), 0, blocks(i, 8)) for i, p in enumerate(prompts)))
    batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
    logits, state = mf.forward(model.params, state, batch, mode)
    tokens = [[t] for t in logits[: mode.num_logits].argmax(-1).tolist()]
    for _ in range(steps - 1):
        plan = mf.StepPlan(decode=tuple(
            mf.SeqPlan((t[-1],), len(p) + len(t) - 1, blocks(i, 8)) for i, (p, t) in enumerate(zip(prompts, tokens))
        ))
        batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
        logits, state = mf.forward(model.params, state, batch, mode)
        for t, new in zip(tokens, logits[: mode.num_logits].argmax(-1).tolist()):
            t.append(new)
    return tokens


@pytest.mark.parametrize("block_size", [16])
def test_greedy_tokens_identical_in_float32(block_size):
    model = mf.load_model("tiny", dtype=torch.float32, device=DEVICE, seed=21)
    prompts = [[5, 17, 300, 2, 9, 41], [77, 3], [123, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    assert greedy(model, "triton", prompts, 6, block_size) == greedy(model, "torch", prompts, 6, block_size)


def test_bfloat16_logits_within_bf16_tolerance():
    model = mf.load_model("tiny", dtype=torch.bfloat16, device=DEVICE, seed=22)
    plans = [
        mf.StepPlan(prefill=(mf.SeqPlan(tuple(range(3, 24)), 0, blocks(0, 8), 21), mf.SeqPlan((9, 8, 7), 0, blocks(1, 8), 3))),
        mf.StepPlan(prefill=(mf.SeqPlan((40, 41, 42), 3, blocks(1, 8), 3),), decode=(mf.SeqPlan((50,), 21, blocks(0, 8)),)),
    ]
    want = run_plan(model, "torch", plans, 16)
    got = run_plan(model, "triton", plans, 16)
    # bf16 carries 8 significant bits; a few roundings through 3 layers stay well inside 3%.
    assert rel_err(got, want) <= 3e-2
