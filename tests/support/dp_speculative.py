"""The speculative runs of the data-parallel attention tests (gloo on the CPU, NCCL on two GPUs): one engine
drafting K tokens a step over repetitive prompts of other lengths, the steps every rank planned recorded, and
each rank's own draft counts read back from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import mla_func as mf
from mla_func.parallel import Parallel
from mla_func.serving.rank_scheduler import RanksStep
from support.parallel_gpu_runs import save_rank_result
from support.parallel_jobs import GraphSteps
from support.parallel_runs import BLOCK_SIZE

K = 3                          # drafts a verify step checks: chains of up to K - 1 drafter steps
VOCAB = 16                     # at least 7 (`mtp_checkpoints`), even (V4's tiny configs)
PATTERNS = (4, 3, 5)           # each prompt: a random pattern of this many tokens, three times over
MAX_TOKENS = (11, 5, 9)        # rank 0 runs the first and last, rank 1 the second (round robin)
ALONE = 2                      # the prompt run alone afterwards, on rank 0
RUNS = ("v3", "v4")


def prompts_of(vocab: int) -> list[list[int]]:
    """The three prompts: a random pattern of each PATTERNS length over `vocab` tokens, three times over."""
    return [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(70 + n)).tolist() * 3
            for n in PATTERNS]


def params_of(max_tokens: int) -> mf.SamplingParams:
    """Greedy, exactly max_tokens tokens."""
    return mf.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drafting_run(model: mf.Model, k: int) -> dict[str, Any]:
    """The greedy tokens of the three prompts, then of one alone, through an engine drafting k tokens a step
    (0: none); every step as every rank planned it, with the tokens every rank recorded (one process: a rank
    of its own); the drafter steps this process ran (0 without drafts), how many of them replayed a CUDA graph,
    and its (drafted, accepted) counts."""
    engine = mf.Engine(model, num_blocks=48, block_size=BLOCK_SIZE, max_num_seqs=2, max_num_batched_tokens=8,
                       long_prefill_token_threshold=6, speculative_tokens=k)
    steps: list[tuple[tuple[mf.StepPlan | None, ...], list[Any]]] = []
    update = engine.scheduler.update

    def recorded(step: Any, sampled: Any) -> Any:
        every = step.steps if isinstance(step, RanksStep) else (step,)
        plans = tuple(None if s is None else s.plan for s in every)
        steps.append((plans, list(sampled)))
        return update(step, sampled)

    engine.scheduler.update = recorded  # type: ignore[method-assign]
    drafter = None
    if k:
        drafter = GraphSteps(engine._speculative.drafter)
        engine._speculative.drafter = drafter  # type: ignore[assignment]
    prompts = prompts_of(model.config.vocab_size)
    many = engine.generate(prompts, [params_of(m) for m in MAX_TOKENS])
    one = engine.generate([prompts[ALONE]], [params_of(MAX_TOKENS[ALONE])])
    stats = engine.speculative_stats
    return {"many": [list(c.token_ids) for c in many], "one": [list(c.token_ids) for c in one], "steps": steps,
            "drafter_steps": 0 if drafter is None else drafter.steps,
            "drafter_graph_steps": 0 if drafter is None else drafter.graph_steps,
            "counts": (stats.drafted, stats.accepted)}


def own_counts(steps: list[tuple[tuple[mf.StepPlan | None, ...], list[Any]]], rank: int) -> tuple[int, int]:
    """(drafted, accepted) of rank `rank`'s verify rows, from every step's plans and the tokens every rank
    recorded (rows rank by rank): q - 1 drafts a row, and the tokens a row kept beyond its one are its accepted
    drafts (no row is cut short: ignore_eos, and q fits max_tokens)."""
    drafted = accepted = 0
    for plans, sampled in steps:
        plan = plans[rank]
        if plan is None:
            continue
        start = sum(len(p.prefill) + len(p.decode) for p in plans[:rank] if p is not None) + len(plan.prefill)
        rows = sampled[start:start + len(plan.decode)]
        drafted += (plan.decode_q_len - 1) * len(rows)
        accepted += sum(len(tokens) - 1 for tokens in rows)
    return drafted, accepted


def dp_speculative_rank(task: tuple[tuple[str, ...], str], parallel: Parallel) -> int:
    """One NCCL rank (`run_ranks`' function): task (checkpoint folders, output folder); each folder loaded on this
    rank's GPU in float32 with data-parallel attention and its MTP layer. Saves {folder: `drafting_run` with K
    drafts} to rank{r}.pt, or the error it raised (`save_rank_result`)."""
    folders, out = task

    def results() -> dict[str, Any]:
        found = {}
        for folder in folders:
            model = mf.load_model(folder, dtype=torch.float32, device=torch.device("cuda", parallel.rank), mtp=True,
                                  parallel=dataclasses.replace(parallel, data_parallel_attention=True))
            found[folder] = drafting_run(model, K)
            del model
            torch.cuda.empty_cache()
        return found

    return save_rank_result(out, parallel, results)
