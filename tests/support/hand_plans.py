"""Hand-made plans for tests: sequences with fixed block tables, run step by step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import mla_func as mf


@dataclass
class Seq:
    """A test sequence: its tokens so far in the cache and its block table."""

    block_table: tuple[int, ...]
    cached: int = 0


def blocks(index: int, per_seq: int) -> tuple[int, ...]:
    """Disjoint block tables: sequence `index` owns blocks [1 + index * per_seq, ...)."""
    start = 1 + index * per_seq
    return tuple(range(start, start + per_seq))


def prefill_plan(seq: Seq, tokens: list[int], *, all_logits: bool = True) -> mf.SeqPlan:
    return mf.SeqPlan(tuple(tokens), seq.cached, seq.block_table, len(tokens) if all_logits else 1)


def decode_plan(seq: Seq, token: int) -> mf.SeqPlan:
    return mf.SeqPlan((token,), seq.cached, seq.block_table, 1)


def run(model: mf.Model, state, plan: mf.StepPlan, **kwargs):
    """Decide, build and run one step; returns (real logits rows, new state)."""
    batch, mode = mf.plan_step(model.config, state, plan, **kwargs)
    logits, state = mf.forward(model.params, state, batch, mode)
    return logits[: mode.num_logits], state


def prefill_in_chunks(model: mf.Model, state, seq: Seq, tokens: list[int], chunk: int, **kwargs):
    """Prefill `tokens` `chunk` at a time with every token's logits; returns ([T, V], state)."""
    outs = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        logits, state = run(model, state, mf.StepPlan(prefill=(prefill_plan(seq, piece),)), **kwargs)
        seq.cached += len(piece)
        outs.append(logits)
    return torch.cat(outs), state


def logits_of(model, tokens):
    state = mf.init_state(model.config, num_blocks=16, block_size=4, dtype=model.dtype)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), 0, tuple(range(1, 1 + math.ceil(len(tokens) / 4))), len(tokens)),))
    batch, mode = mf.plan_step(model.config, state, plan)
    return mf.forward(model.params, state, batch, mode)[0]
