"""Hand-made plans for tests: sequences with fixed block tables, run step by step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import mla_func as mf


@dataclass
class Seq:
    """A test sequence: its tokens so far in the cache, its block table, and those of cache groups 1..
    (a model with several groups)."""

    block_table: tuple[int, ...]
    cached: int = 0
    group_tables: tuple[tuple[int, ...], ...] = ()


def blocks(index: int, per_seq: int) -> tuple[int, ...]:
    """Disjoint block tables: sequence `index` owns blocks [1 + index * per_seq, ...)."""
    start = 1 + index * per_seq
    return tuple(range(start, start + per_seq))


def prefill_plan(seq: Seq, tokens: list[int], *, all_logits: bool = True) -> mf.SeqPlan:
    return mf.SeqPlan(tuple(tokens), seq.cached, seq.block_table, len(tokens) if all_logits else 1,
                      group_block_tables=seq.group_tables)


def decode_plan(seq: Seq, token: int) -> mf.SeqPlan:
    return mf.SeqPlan((token,), seq.cached, seq.block_table, 1, group_block_tables=seq.group_tables)


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


def prefill_then_decode(model: mf.Model, state, seq: Seq, tokens: list[int], prompt: int, **kwargs):
    """Teacher forcing: prefill tokens[:prompt] in one step, then decode each later token in a step of its
    own; returns (every position's logits [len(tokens), V], state)."""
    got, state = prefill_in_chunks(model, state, seq, tokens[:prompt], chunk=prompt, **kwargs)
    rows = [got]
    for token in tokens[prompt:]:
        logits, state = run(model, state, mf.StepPlan(decode=(decode_plan(seq, token),)), **kwargs)
        seq.cached += 1
        rows.append(logits)
    return torch.cat(rows), state


def mixed_step_and_alone(model: mf.Model, new_state, prompts: list[list[int]], next_tokens: list[int], per_seq: int,
                         *, all_logits: bool):
    """The first len(next_tokens) prompts prefill, then each decodes its next token; the rest only prefill.
    Each sequence alone, and all together: the decoders' prefill, then one mixed step (the others' prefill
    beside the decoders' decode). Returns (together, alone), each a list of one logits tensor per sequence,
    in prompt order: a decoder's decode row [1, V]; a prefill's rows [len(prompt), V] with `all_logits`, else
    its last row [1, V]. `new_state()` makes an empty state."""
    num_decoders = len(next_tokens)
    alone = []
    for i, prompt in enumerate(prompts):
        seq = Seq(blocks(i, per_seq))
        logits, state = prefill_in_chunks(model, new_state(), seq, prompt, chunk=len(prompt))
        if i < num_decoders:
            logits, _ = run(model, state, mf.StepPlan(decode=(decode_plan(seq, next_tokens[i]),)))
        alone.append(logits if all_logits or i < num_decoders else logits[-1:])
    seqs = [Seq(blocks(i, per_seq)) for i in range(len(prompts))]
    decoders = range(num_decoders)
    _, state = run(model, new_state(), mf.StepPlan(prefill=tuple(prefill_plan(seqs[i], prompts[i], all_logits=False)
                                                                 for i in decoders)))
    for i in decoders:
        seqs[i].cached = len(prompts[i])
    plan = mf.StepPlan(prefill=tuple(prefill_plan(seqs[i], prompts[i], all_logits=all_logits)
                                     for i in range(num_decoders, len(prompts))),
                       decode=tuple(decode_plan(seqs[i], next_tokens[i]) for i in decoders))
    batch, mode = mf.plan_step(model.config, state, plan)
    assert mode.kind == "mixed"
    logits, _ = mf.forward(model.params, state, batch, mode)
    rows = [len(prompts[i]) if all_logits else 1 for i in range(num_decoders, len(prompts))] + [1] * num_decoders
    parts = list(logits.split(rows))  # prefill rows come first
    return parts[len(prompts) - num_decoders:] + parts[: len(prompts) - num_decoders], alone


def logits_of(model, tokens):
    state = mf.init_state(model.config, num_blocks=16, block_size=4, dtype=model.dtype)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), 0, tuple(range(1, 1 + math.ceil(len(tokens) / 4))), len(tokens)),))
    batch, mode = mf.plan_step(model.config, state, plan)
    return mf.forward(model.params, state, batch, mode)[0]
