"""What the spawned ranks of the FP8, MTP and data-parallel engine tests run (`parallel_runs.spawn_group`),
and the same runs on one process, so a test compares a group's results with one process's.

`drafts(model)` runs the MTP drafter directly (its logits over a prefill's hidden states) and the
engine's speculative decoding; `engine_run(model, ...)` runs the engine's greedy generation of a set
of prompts, on any model: whole, tensor-parallel or with data-parallel attention. `job_agreed_steps`
(gloo) and `dp_graphs_rank` (NCCL, with CUDA graphs) run steps whose padding the ranks agree on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import mla_func as mf
from mla_func.core.step import Step
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.mtp.layer import drafter_params, init_drafter_state, mtp_layer, target_step_fn
from mla_func.parallel import Parallel
from mla_func.parallel.data_parallel import plan_rank_step
from mla_func.serving.rank_scheduler import RanksStep
from support.graph_checks import LADDER
from support.parallel_gpu_runs import DTYPES, save_rank_result
from support.hand_plans import Seq, prefill_plan
from support.mtp_checkpoints import drafting_engine, drafting_requests
from support.parallel_runs import BLOCK_SIZE, WORLD, RankTask, held, rank_steps, scenarios, spawn_group

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


# DeepSeek-V4's drafter: a prefill of DRAFT_PROMPT rows, then DRAFT_DECODES decode steps of one row each.
DRAFT_PROMPT = 11
DRAFT_DECODES = 3
DRAFT_BLOCKS = 8   # of group 0 a sequence: room for DRAFT_PROMPT + DRAFT_DECODES + 1 tokens


def v4_drafter_steps(model: mf.Model) -> dict[str, torch.Tensor]:
    """The MTP drafter's logits of a DeepSeek-V4 model (loaded with mtp=True) over the target's streams:
    {"draft_prefill": [DRAFT_PROMPT, V] of one prefill step, "draft_decode": [DRAFT_DECODES, V] of the
    decode steps after it}; row i reads the token at i + 1 and the target's streams at i."""
    tokens = _tokens(DRAFT_PROMPT + DRAFT_DECODES + 1, model.config.vocab_size, seed=9)
    n = len(tokens) - 1
    state = mf.init_state(model, num_blocks=2 * DRAFT_BLOCKS, block_size=BLOCK_SIZE)
    # The compressed layers' cache groups need tables of their own (`CacheGroup.blocks_for`).
    seq = Seq(tuple(range(1, 1 + DRAFT_BLOCKS)), group_tables=tuple(
        tuple(range(1, 1 + group.blocks_for(DRAFT_BLOCKS * BLOCK_SIZE))) for group in state.groups[1:]))
    target, state = target_step_fn(model.params, state, *mf.plan_step(
        model.config, state, mf.StepPlan(prefill=(prefill_plan(seq, tokens[:n]),))))
    dstate, params, layers = init_drafter_state(model, state), drafter_params(model), (mtp_layer(model.config),)
    rows = []
    for start, end in [(0, DRAFT_PROMPT), *((i, i + 1) for i in range(DRAFT_PROMPT, n))]:
        part = mf.SeqPlan(tuple(tokens[start + 1:end + 1]), start, seq.block_table, end - start,
                          group_block_tables=seq.group_tables)
        plan = mf.StepPlan(prefill=(part,)) if start == 0 else mf.StepPlan(decode=(part,))
        batch, mode = mf.plan_step(model.config, dstate, plan)
        out, dstate = mf.forward_outputs(params, dstate, dataclasses.replace(batch, hidden=target.hidden[start:end]),
                                         mode, layers=layers)
        rows.append(out.logits[:mode.num_logits])
    return {"draft_prefill": rows[0], "draft_decode": torch.cat(rows[1:])}


def job_v4_mtp(task: RankTask, parallel: Parallel) -> dict[Any, Any]:
    """task.args: (DeepSeek-V4 checkpoint folder with an MTP layer, expert_parallel) pairs, each loaded with
    mtp=True; {pair: `v4_drafter_steps`, the greedy tokens and (drafted, accepted) of an engine drafting
    SPECULATIVE tokens a step (`mtp_checkpoints.drafting_engine`), and what the MTP layer holds}."""
    results = {}
    for path, expert_parallel in task.args:
        model = mf.load_model(path, dtype=torch.float32, device="cpu", mtp=True,
                              parallel=dataclasses.replace(parallel, expert_parallel=expert_parallel))
        results[(path, expert_parallel)] = {**v4_drafter_steps(model), **v4_speculative(model),
                                            "mtp_held": v4_mtp_held(model)}
    return results


def v4_speculative(model: mf.Model) -> dict[str, Any]:
    """The greedy tokens of `mtp_checkpoints.drafting_requests` through an engine drafting SPECULATIVE tokens a
    step, and its (drafted, accepted) draft counts."""
    engine = drafting_engine(model, SPECULATIVE)
    completions = engine.generate(*drafting_requests(SPECULATIVE, model.config.vocab_size))
    stats = engine.speculative_stats
    return {"speculative": [list(c.token_ids) for c in completions], "accepted": (stats.drafted, stats.accepted)}


def v4_mtp_held(model: mf.Model) -> dict[str, Any]:
    """What a V4 model's MTP layer holds: its heads, the experts of its stacked expert weights, the shape
    of its e_proj, and its layer's quantized pairs as `quantized_held` gives them."""
    layer = model.mtp.layer
    return {"heads": layer.attn.sinks.shape[0], "experts": layer.mlp.w2.shape[0],
            "e_proj": tuple(model.mtp.e_proj.shape),
            "pairs": {name: shapes for name, shapes in quantized_held(model).items() if name.startswith("mtp.")}}


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
    return {"many": [list(c.token_ids) for c in many], "one": [list(c.token_ids) for c in one],
            "steps": len(idle), "idle_steps": sum(idle), "score": engine.score(prompts[1]),
            "logprobs": logprobs_run(engine, prompts)}


# The logprobs requests of `logprobs_run`: (prompt of `engine_run`'s, SamplingParams keywords). Added together
# they go round robin (ranks 0, 1, 0, 1): rank 1's end first, so rank 0 runs on alone with rank 1 idle.
LOGPROBS_REQUESTS = (
    (0, {"max_tokens": 6, "temperature": 0.0, "logprobs": 3}),
    (1, {"max_tokens": 2, "temperature": 0.0}),                       # a row that asks for no logprobs
    (2, {"max_tokens": 5, "temperature": 0.8, "seed": 5, "logprobs": 3}),
    (3, {"max_tokens": 3, "temperature": 1.0, "seed": 7, "logprobs": 1, "prompt_logprobs": 2}),
)


def logprobs_run(engine: mf.Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """`LOGPROBS_REQUESTS`' completions as plain values: {"tokens", "logprobs": per token (its logprob,
    ((top id, logprob), ...)), "prompt_logprobs": per prompt token the same or None}."""
    def plain(entry: Any) -> Any:
        return None if entry is None else (entry.logprob, tuple(entry.top.items()))

    completions = engine.generate([prompts[i] for i, _ in LOGPROBS_REQUESTS],
                                  [mf.SamplingParams(ignore_eos=True, **kw) for _, kw in LOGPROBS_REQUESTS])
    return [{"tokens": list(c.token_ids), "error": None if c.error is None else str(c.error),
             "logprobs": None if c.logprobs is None else [plain(t) for t in c.logprobs],
             "prompt_logprobs": None if c.prompt_logprobs is None else [plain(t) for t in c.prompt_logprobs]}
            for c in completions]


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


# Rank 1 of `agreed_plans` runs `rank_steps`' first AGREED_BUSY steps (prefill, decode), then idles while
# rank 0 decodes, runs a mixed step and verifies.
AGREED_BUSY = 2


def agreed_plans(model: mf.Model, world: int) -> list[list[mf.StepPlan]]:
    """Every rank's steps of `job_agreed_steps`: `rank_steps`', rank 1's empty (idle) after its first
    AGREED_BUSY."""
    every_rank = [rank_steps(model, r) for r in range(world)]
    every_rank[1] = every_rank[1][:AGREED_BUSY] + [mf.StepPlan()] * (len(every_rank[1]) - AGREED_BUSY)
    return every_rank


def job_agreed_steps(task: RankTask, parallel: Parallel) -> dict[Any, Any]:
    """task.args: (checkpoint folder,) each, loaded with data-parallel attention; {args: this rank's
    `agreed_plans` steps padded as a graph step pads them (graphs=True over `graph_checks.LADDER`: the sizes
    the ranks agree on, `plan_rank_step`) and run eagerly: {"logits": each busy step's real logits rows (None
    where idle), "keys": each step's static key, "graph": whether its mode was to replay a graph}}."""
    results = {}
    for args in task.args:
        model = mf.load_model(args[0], dtype=torch.float32, device="cpu",
                              parallel=dataclasses.replace(parallel, data_parallel_attention=True))
        every_rank = agreed_plans(model, task.world)
        state = mf.init_state(model, num_blocks=48, block_size=BLOCK_SIZE)
        out: dict[str, list[Any]] = {"logits": [], "keys": [], "graph": []}
        for i, plan in enumerate(every_rank[task.rank]):
            batch, mode = plan_rank_step(model.config, state, [plans[i] for plans in every_rank], task.rank,
                                         padding=LADDER, graphs=True, max_position=model.max_positions)
            logits, state = mf.forward(model.params, state, batch, mode)
            out["logits"].append(logits[:mode.num_logits] if plan.num_seqs else None)
            out["keys"].append(mode.static_key)
            out["graph"].append(mode.use_graph)
        results[args] = out
    return results


class GraphSteps:
    """An engine's step that counts the steps it ran and those it replayed from a CUDA graph; anything
    else is the step's."""

    def __init__(self, step: Step) -> None:
        self.step, self.steps, self.graph_steps = step, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)

    def __call__(self, *args: Any) -> Any:
        state, out = self.step(*args)
        self.steps += 1
        self.graph_steps += out.graph
        return state, out


def graph_engine_run(model: mf.Model, *, graphs: bool) -> dict[str, Any]:
    """`engine_run`'s greedy generations (five prompts, the ranks' loads uneven and one rank idle at the end;
    then one prompt, the other rank idle throughout) through an engine with or without CUDA graphs, warmed
    up: their tokens, the keys warm-up captured and those captured by the end, and the steps run and those
    replayed from a graph."""
    vocab = model.config.vocab_size
    engine = mf.Engine(model, num_blocks=48, block_size=BLOCK_SIZE, max_num_seqs=2, max_num_batched_tokens=8,
                       long_prefill_token_threshold=6, max_model_len=64, graphs=graphs)
    engine.warmup(progress=False, freeze_gc=False)
    warm_keys = engine.step.captured_keys
    counted = GraphSteps(engine.step)
    engine.step = counted  # type: ignore[assignment]
    prompts = [_tokens(n, vocab, seed=80 + n) for n in PROMPT_LENGTHS]
    params = [mf.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    many = engine.generate(prompts, params)
    one = engine.generate([prompts[2]], [params[2]])
    return {"many": [list(c.token_ids) for c in many], "one": [list(c.token_ids) for c in one],
            "warm_keys": warm_keys, "keys": counted.captured_keys, "steps": counted.steps,
            "graph_steps": counted.graph_steps}


def dp_graphs_rank(task: tuple[str, str, tuple[str, ...]], parallel: Parallel) -> int:
    """One NCCL rank of the data-parallel graph test (`run_ranks`' function): task (checkpoint folder, output
    folder, dtype names of `parallel_gpu_runs.DTYPES`). Saves {dtype: {"graphs": `graph_engine_run` with graphs,
    "eager": without}} to rank{r}.pt, or the error it raised (`save_rank_result`)."""
    path, out, dtypes = task

    def results() -> dict[str, Any]:
        found = {}
        for dtype in dtypes:
            model = mf.load_model(path, dtype=DTYPES[dtype], device=torch.device("cuda", parallel.rank),
                                  parallel=dataclasses.replace(parallel, data_parallel_attention=True))
            found[dtype] = {"graphs": graph_engine_run(model, graphs=True),
                            "eager": graph_engine_run(model, graphs=False)}
            del model
            torch.cuda.empty_cache()
        return found

    return save_rank_result(out, parallel, results)
