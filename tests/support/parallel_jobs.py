"""What the spawned ranks of the FP8, MTP and data-parallel engine tests run (`parallel_runs.spawn_group`),
and the same runs on one process, so a test compares a group's results with one process's.

`drafts(model)` runs the MTP drafter directly (its logits over a prefill's hidden states) and the
engine's speculative decoding; `engine_run(model, ...)` runs the engine's greedy generation of a set
of prompts, on any model: whole, tensor-parallel or with data-parallel attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import mla_func as mf
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.mtp.layer import drafter_params, init_drafter_state, mtp_layer, target_step_fn
from mla_func.parallel import Parallel
from mla_func.serving.rank_scheduler import RanksStep
from support.parallel_runs import BLOCK_SIZE, WORLD, RankTask, held, scenarios, spawn_group

SPECULATIVE = 2   # drafts a verify step checks
PROMPT = 11


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drafts(model: mf.Model) -> dict[str, Any]:
    """The drafter's logits over one prefill's hidden states, and the speculative engine's greedy tokens
    and accepted drafts."""
    vocab = model.config.vocab_size
    tokens = _tokens(PROMPT + 1, vocab, seed=7)
    state = mf.init_state(model, num_blocks=16, block_size=BLOCK_SIZE)
    table = tuple(range(1, 5))
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens[:PROMPT]), 0, table, PROMPT),))
    out, state = target_step_fn(model.params, state, *mf.plan_step(model.config, state, plan))
    # Row i continues from the target's hidden state at position i with the token at i + 1.
    dstate = init_drafter_state(model, state)
    shifted = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens[1:PROMPT + 1]), 0, table, PROMPT),))
    batch, mode = mf.plan_step(model.config, dstate, shifted)
    drafted, _ = mf.forward_outputs(drafter_params(model), dstate, dataclasses.replace(batch, hidden=out.hidden),
                                    mode, layers=(mtp_layer(model.config),))
    engine = mf.Engine(model, num_blocks=48, block_size=BLOCK_SIZE, max_num_seqs=4, speculative_tokens=SPECULATIVE)
    # Repetitive prompts, which an echoing drafter (`mtp_checkpoints.add_mtp_layer(echo=True)`) guesses well.
    completions = engine.generate([_tokens(n, vocab, seed=60 + n) * 3 for n in (2, 3, 1)],
                                  mf.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stats = engine.speculative_stats
    return {"drafter": drafted.logits[:mode.num_logits], "speculative": [list(c.token_ids) for c in completions],
            "accepted": (stats.drafted, stats.accepted)}


def quantized_held(model: mf.Model) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{field: (values shape, scales shape)} of every quantized pair of the first layer's attention and
    feed-forward blocks, and of the MTP layer's (a model loaded with mtp=True). The first layer has no
    indexer, whose projections are replicated rows of the attention's."""
    layers = {"layer0": model.params.layers[0]}
    if model.mtp is not None:
        layers["mtp"] = model.mtp.layer
    out = {}
    for name, layer in layers.items():
        for block in ("attn", "mlp"):
            part = getattr(layer, block)
            for field in dataclasses.fields(part):
                w = getattr(part, field.name)
                if isinstance(w, BlockFP8Weight):
                    out[f"{name}.{block}.{field.name}"] = (tuple(w.values.shape), tuple(w.scale_inv.shape))
                elif isinstance(w, BlockFP4Weight):
                    out[f"{name}.{block}.{field.name}"] = (tuple(w.shape), tuple(w.scale.shape))
    return out


def job_quantized(task: RankTask, parallel: Parallel) -> dict[Any, Any]:
    """task.args: (checkpoint folder, expert_parallel, mtp) triples; {triple: `scenarios`, `drafts` (with mtp)
    and what the rank held}, or {triple: {"refused": the message}} where loading raised CheckpointError
    or ValueError (a split the checkpoint's blocks refuse)."""
    results: dict[Any, Any] = {}
    for path, expert_parallel, mtp in task.args:
        try:
            model = mf.load_model(path, dtype=torch.float32, device="cpu", mtp=mtp,
                                  parallel=dataclasses.replace(parallel, expert_parallel=expert_parallel))
        except ValueError as e:  # CheckpointError is one
            results[(path, expert_parallel, mtp)] = {"refused": f"{type(e).__name__}: {e}"}
            continue
        results[(path, expert_parallel, mtp)] = {**scenarios(model), **(drafts(model) if mtp else {}),
                                                 "held": held(model), "quantized": quantized_held(model)}
    return results


# The engine's prompts: more than the ranks, an odd count, of other lengths and lengths to generate, so
# the ranks' loads differ and one rank runs out of requests while the other still has some.
PROMPT_LENGTHS = (3, 9, 14, 6, 11)
MAX_TOKENS = (6, 3, 8, 5, 4)


def engine_run(model: mf.Model) -> dict[str, Any]:
    """The engine's greedy tokens of five prompts (chunked prefills, mixed steps, a queue), then of one prompt
    (a second rank has nothing to do), and how many steps had a rank idle (data-parallel attention)."""
    vocab = model.config.vocab_size
    engine = mf.Engine(model, num_blocks=48, block_size=BLOCK_SIZE, max_num_seqs=2, max_num_batched_tokens=8,
                       long_prefill_token_threshold=6)
    idle = []
    schedule = engine.scheduler.schedule

    def recorded() -> Any:
        step = schedule()
        if isinstance(step, RanksStep):
            idle.append(any(s is None for s in step.steps))
        return step

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    prompts = [_tokens(n, vocab, seed=80 + n) for n in PROMPT_LENGTHS]
    params = [mf.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    many = engine.generate(prompts, params)
    one = engine.generate([prompts[2]], [params[2]])
    logprobs = engine.generate([prompts[0]], mf.SamplingParams(max_tokens=2, logprobs=1))[0]
    return {"many": [list(c.token_ids) for c in many], "one": [list(c.token_ids) for c in one],
            "steps": len(idle), "idle_steps": sum(idle), "score": engine.score(prompts[1]),
            "logprobs_error": None if logprobs.error is None else str(logprobs.error)}


def job_engine(task: RankTask, parallel: Parallel) -> dict[Any, Any]:
    """task.args: (checkpoint folder, expert_parallel) pairs, each loaded with data-parallel attention;
    {pair: `engine_run`}."""
    results = {}
    for path, expert_parallel in task.args:
        model = mf.load_model(path, dtype=torch.float32, device="cpu", parallel=dataclasses.replace(
            parallel, expert_parallel=expert_parallel, data_parallel_attention=True))
        results[(path, expert_parallel)] = engine_run(model)
    return results


def runs_of_every_rank(job: Callable[[RankTask, Parallel], dict[Any, Any]], runs: dict[str, tuple[Any, ...]],
                       out: Path) -> dict[str, list[Any]]:
    """{run name: [what each rank's `job` gave for its arguments `runs[name]`]}, from one spawned group of
    `WORLD` ranks for every run; fails naming a rank that saved nothing or raised."""
    results = spawn_group(job, WORLD, out, args=tuple(runs.values()))
    assert sorted(results) == list(range(WORLD)), f"ranks that saved nothing: {set(range(WORLD)) - set(results)}"
    for rank, result in results.items():
        assert "raised" not in result, f"rank {rank}: {result.get('traceback')}"
    return {name: [results[r][args] for r in range(WORLD)] for name, args in runs.items()}
