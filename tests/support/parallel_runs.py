"""Sharded runs for the parallel tests: the steps every rank runs, and the spawned ranks themselves.

`scenarios(model)` runs the same steps (one-shot and chunked prefill, decode, a mixed step, a
verify step, the engine's greedy generation) on any model, sharded or not, so a test compares
a group's results with one process's. `spawn_group` starts gloo ranks in fresh processes and
collects what each rank saved, or the error it raised, within a deadline; a rank that outlives it is
killed, never waited on. The ranks come from multiprocessing's fork server: a fresh interpreter,
started once a pytest worker, that imports torch, mla_func and this module and then forks each rank,
so no state is shared with pytest's process and a rank does not pay the imports (about 3.5 s on a
two-core machine, most of a small group's time) again.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import mla_func as mf
from mla_func.kernels.collectives import CollectiveError
from mla_func.parallel import Parallel, join, leave
from mla_func.parallel.data_parallel import plan_rank_step
from mla_func.parallel.workers import free_local_port
from mla_func.models.v4.params import V4AttentionParams, V4ExpertShardParams
from support.hand_plans import Seq, blocks, decode_plan, prefill_in_chunks, prefill_plan, prefill_then_decode, run

WORLD = 2  # ranks of every spawned group of the parallel tests
# What every rank imports anyway, imported once by the fork server the ranks are forked from.
_RANK_IMPORTS = ["torch", "mla_func", "support.parallel_runs", "support.parallel_jobs"]
# fp32: the ranks' partial sums add up in another order than one GEMM's; nothing else differs.
TOL = 1e-5
STEP_KINDS = ("prefill", "chunked", "decode", "mixed", "verify")
# mode -> (Parallel.expert_parallel, Parallel.data_parallel_attention)
MODES = {"tp": (False, False), "ep": (True, False), "dp": (False, True), "dp-ep": (True, True)}
TP_MODES = sorted(m for m, (_, dp) in MODES.items() if not dp)
DP_MODES = sorted(m for m, (_, dp) in MODES.items() if dp)

BLOCK_SIZE = 4
BLOCKS_A_SEQ = 8  # of group 0: every test sequence is shorter than BLOCKS_A_SEQ * BLOCK_SIZE tokens
PROMPT = 13
DECODE_STEPS = 4


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _state(model: mf.Model) -> Any:
    return mf.init_state(model, num_blocks=48, block_size=BLOCK_SIZE)  # the model's dtype and device


def _seq(groups: tuple[mf.CacheGroup, ...], index: int) -> Seq:
    """Test sequence `index`: blocks of its own in every cache group (groups 1.. where the model has them)."""
    tables = []
    for group in groups[1:]:
        n = group.blocks_for(BLOCKS_A_SEQ * BLOCK_SIZE)
        tables.append(tuple(range(1 + index * n, 1 + (index + 1) * n)))
    return Seq(blocks(index, BLOCKS_A_SEQ), group_tables=tuple(tables))


def scenarios(model: mf.Model) -> dict[str, Any]:
    """Every step kind's logits, and the engine's greedy tokens, of `model` (sharded or not)."""
    vocab = model.config.vocab_size
    groups = _state(model).groups
    tokens = _tokens(PROMPT + DECODE_STEPS, vocab, seed=1)
    out: dict[str, Any] = {}
    out["prefill"], _ = prefill_in_chunks(model, _state(model), _seq(groups, 0), tokens[:PROMPT], chunk=PROMPT)
    out["chunked"], _ = prefill_in_chunks(model, _state(model), _seq(groups, 1), tokens[:PROMPT], chunk=5)
    out["decode"], _ = prefill_then_decode(model, _state(model), _seq(groups, 0), tokens, PROMPT)

    # Mixed: two sequences decode while two others prefill.
    prompts = [_tokens(n, vocab, seed=10 + n) for n in (7, 5, 9, 4)]
    seqs = [_seq(groups, i) for i in range(4)]
    state = _state(model)
    _, state = run(model, state, mf.StepPlan(prefill=tuple(prefill_plan(seqs[i], prompts[i]) for i in (0, 1))))
    for i in (0, 1):
        seqs[i].cached = len(prompts[i])
    out["mixed"], _ = run(model, state, mf.StepPlan(
        prefill=tuple(prefill_plan(seqs[i], prompts[i]) for i in (2, 3)),
        decode=tuple(decode_plan(seqs[i], prompts[i][0]) for i in (0, 1))))

    # Verify: three query tokens a sequence after a prefill (decode_q_len = drafts + 1).
    seq = _seq(groups, 2)
    _, state = run(model, _state(model), mf.StepPlan(prefill=(prefill_plan(seq, tokens[:PROMPT]),)))
    seq.cached = PROMPT
    out["verify"], _ = run(model, state, mf.StepPlan(
        decode=(mf.SeqPlan(tuple(tokens[PROMPT:PROMPT + 3]), PROMPT, seq.block_table, 3, seq.group_tables),),
        decode_q_len=3))

    engine = mf.Engine(model, num_blocks=48, block_size=BLOCK_SIZE, max_num_seqs=4)
    completions = engine.generate([_tokens(n, vocab, seed=30 + n) for n in (6, 11, 3)],
                                  mf.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    out["greedy"] = [list(c.token_ids) for c in completions]
    return out


def rank_steps(model: mf.Model, rank: int) -> list[mf.StepPlan]:
    """Rank `rank`'s steps under data-parallel attention: its own sequences, of lengths that differ
    by rank, through prefill, decode, a mixed step and a verify step (blocks fixed by hand)."""
    vocab, groups = model.config.vocab_size, _state(model).groups
    a = _tokens(PROMPT + 3 * rank + 6, vocab, seed=100 + rank)
    b = _tokens(4 + 2 * rank, vocab, seed=200 + rank)
    n = PROMPT + 3 * rank
    seq_a, seq_b = _seq(groups, 0), _seq(groups, 1)

    def part(seq: Seq, tokens: list[int], start: int, logits: int) -> mf.SeqPlan:
        return mf.SeqPlan(tuple(tokens), start, seq.block_table, logits, seq.group_tables)

    return [
        mf.StepPlan(prefill=(part(seq_a, a[:n], 0, n),)),
        mf.StepPlan(decode=(part(seq_a, a[n:n + 1], n, 1),)),
        mf.StepPlan(decode=(part(seq_a, a[n + 1:n + 2], n + 1, 1),)),
        mf.StepPlan(prefill=(part(seq_b, b, 0, len(b)),), decode=(part(seq_a, a[n + 2:n + 3], n + 2, 1),)),
        mf.StepPlan(decode=(part(seq_a, a[n + 3:n + 6], n + 3, 3),), decode_q_len=3),
    ]


def run_steps(model: mf.Model, plans: list[mf.StepPlan], *, every_rank: list[list[mf.StepPlan]] | None = None,
              rank: int = 0) -> list[torch.Tensor]:
    """Each step's real logits rows; with `every_rank` (every rank's steps), as rank `rank` of a
    data-parallel group."""
    state, out = _state(model), []
    for i, plan in enumerate(plans):
        if every_rank is None:
            batch, mode = mf.plan_step(model.config, state, plan)
        else:
            batch, mode = plan_rank_step(model.config, state, [steps[i] for steps in every_rank], rank)
        logits, state = mf.forward(model.params, state, batch, mode)
        out.append(logits[:mode.num_logits])
    return out


@dataclass(frozen=True)
class RankTask:
    """What one spawned rank does: join a group of `world` on `port`, then `job` (a name in JOBS, or a
    module-level function of (task, parallel) that the spawned process imports, as `support.parallel_jobs`')."""

    job: str | Callable[[RankTask, Parallel], Any]
    rank: int
    world: int
    port: int
    out: str
    timeout_s: float
    args: tuple[Any, ...] = ()


def held(model: mf.Model) -> dict[str, int]:
    """What a model's params hold: the first layer's heads, the embedding's rows, the last layer's routed
    experts, their elements in all."""
    attn = model.params.layers[0].attn
    # V4's attention holds a sink a head; MLA's attention a key up-projection a head.
    heads = attn.sinks.shape[0] if isinstance(attn, V4AttentionParams) else attn.w_uk.shape[0]
    mlp = model.params.layers[-1].mlp
    # An expert-parallel V4 rank holds its routed experts alone in w13 (the shared ones apart); a MoE
    # block of the other families and modes says how many of its experts are routed.
    routed = mlp.w13.shape[0] if isinstance(mlp, V4ExpertShardParams) else mlp.num_routed
    return {"heads": heads, "vocab_rows": model.params.embed.shape[0], "experts": routed,
            "elements": sum(t.numel() for t in mf.pytree.tree_leaves(model.params))}


def _job_scenarios(task: RankTask, parallel: Parallel) -> Any:
    """task.args: (checkpoint folder, expert_parallel, data_parallel_attention) triples; {triple: what the
    rank held, and `scenarios` (tensor-parallel attention) or its `rank_steps`' logits (data-parallel)}."""
    results = {}
    for path, expert_parallel, data_parallel in task.args:
        rank_parallel = dataclasses.replace(parallel, expert_parallel=expert_parallel,
                                            data_parallel_attention=data_parallel)
        model = mf.load_model(path, dtype=torch.float32, device="cpu", parallel=rank_parallel)
        if data_parallel:
            every_rank = [rank_steps(model, r) for r in range(task.world)]
            out: dict[str, Any] = {"steps": run_steps(model, every_rank[task.rank], every_rank=every_rank,
                                                      rank=task.rank)}
        else:
            out = scenarios(model)
        results[(path, expert_parallel, data_parallel)] = {**out, "held": held(model)}
    return results


def _job_die_before_step(task: RankTask, parallel: Parallel) -> Any:
    """Rank 1 dies after loading; rank 0 runs a step, whose first all-reduce must fail, not hang."""
    model = mf.load_model(task.args[0], dtype=torch.float32, device="cpu", parallel=parallel)
    if task.rank == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        scenarios(model)
    except CollectiveError as e:
        return {"error": str(e), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


JOBS = {"scenarios": _job_scenarios, "die_before_step": _job_die_before_step}


def _rank_main(task: RankTask) -> None:
    torch.set_num_threads(1)
    result: Any
    try:
        parallel = join(rank=task.rank, world_size=task.world, init_method=f"tcp://127.0.0.1:{task.port}",
                        backend="gloo", timeout_s=task.timeout_s)
        try:
            result = (JOBS[task.job] if isinstance(task.job, str) else task.job)(task, parallel)
        finally:
            if task.job != "die_before_step":
                leave(parallel)
    except Exception as e:  # reported to the test, which asserts on it
        result = {"raised": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(result, Path(task.out) / f"rank{task.rank}.pt")


def spawn_group(job: str | Callable[[RankTask, Parallel], Any], world: int, out: Path, *,
                ranks: tuple[int, ...] | None = None, timeout_s: float = 30.0, deadline_s: float = 120.0,
                args: tuple[Any, ...] = ()) -> dict[int, Any]:
    """Run `job` on ranks `ranks` (default all of `world`) in spawned processes; {rank: saved result}.

    A rank that saved nothing (it died) is absent. Every process is joined within `deadline_s`
    or killed.
    """
    port = free_local_port()
    context = multiprocessing.get_context("forkserver")
    # Read when the server starts (the first group of a pytest worker); a module that fails to import is
    # skipped there and imported by each rank instead.
    context.set_forkserver_preload(_RANK_IMPORTS)
    procs = {r: context.Process(target=_rank_main, args=(RankTask(job, r, world, port, str(out), timeout_s, args),))
             for r in (range(world) if ranks is None else ranks)}
    for p in procs.values():
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs.values():
        p.join(max(0.0, end - time.monotonic()))
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    return {r: torch.load(out / f"rank{r}.pt", weights_only=False)
            for r in procs if (out / f"rank{r}.pt").exists()}
