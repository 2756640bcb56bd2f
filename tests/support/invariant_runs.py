"""Shared pieces of the batch-invariance tests on CPU: the engine they run, each probe alone, a padded mixed step."""

from __future__ import annotations

import torch

import mla_func as mf
from support.logits_probes import ProbeRun, run_probes
from mla_func.serving.sampling import SamplingParams

# Small budgets, so that a dozen requests meet in chunked, mixed and decode steps.
CPU_ENGINE = dict(num_blocks=400, max_num_seqs=8, max_num_batched_tokens=48, long_prefill_token_threshold=16,
                  batch_invariant=True)
# Ladders a mixed step of 2 prefills (<= 64 tokens) and 3 decode rows is padded to.
MIXED_PADDING = dict(decode_seqs=(4, 8), prefill_tokens=(64,), prefill_seqs=(2, 4))


def cpu_engine(model: mf.Model, block_size: int, **kwargs) -> mf.Engine:
    """A batch-invariant engine with `CPU_ENGINE`'s budgets, as `kwargs` override them."""
    return mf.Engine(model, block_size=block_size, **{**CPU_ENGINE, **kwargs})


def probes_alone(engine: mf.Engine, probes: tuple[list[list[int]], list[SamplingParams]]) -> ProbeRun:
    """Each probe alone: one generate call per probe on `engine`."""
    singles = [run_probes(engine, ([prompt], [params]), ([], []), seed=0) for prompt, params in zip(*probes)]
    return ProbeRun([r.tokens[0] for r in singles], [r.logits[0] for r in singles], 0)


def padded_mixed_logits(model: mf.Model, state, plan: mf.StepPlan, *, table_width: int) -> torch.Tensor:
    """The logits of a batch-invariant mixed step of `plan` (2 prefills, 3 decode rows) padded to
    `MIXED_PADDING` and block tables `table_width` wide: [padded tokens, V]."""
    padding = mf.PaddingPolicy(**MIXED_PADDING, block_table_widths=(table_width,))
    batch, mode = mf.plan_step(model.config, state, plan, padding=padding, batch_invariant=True)
    assert mode.kind == "mixed" and mode.padded_decode_seqs == 4 and mode.padded_prefill_tokens == 64
    logits, _ = mf.forward(model.params, state, batch, mode)
    return logits
