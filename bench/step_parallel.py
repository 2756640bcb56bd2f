"""The decode step on several ranks against one rank, same weights, same run: `bench/step.py --tensor-parallel N`.

Each mode runs in a group of fresh processes of its own (`ranks.run_group`): one rank first, then N
ranks tensor-parallel, then (with --expert-parallel, --data-parallel-attention) the other cuts. Every
rank draws the same random weights and keeps its shard (`ranks.random_shard`), fills its latent cache
with random values, and times the memoized step (`make_step`; on CUDA graphs replay, the collectives
captured inside them) over the same decode plans.

A row is one decode step of `batch` sequences in all, each `context` tokens long. Tensor-parallel
ranks all run every sequence (each holds the whole cache); under data-parallel attention the
sequences are dealt out evenly (rank r runs the r-th N-th over a cache of its own) and a batch N does
not divide is skipped: every rank's step then has the same static key, so the ranks capture their
graphs at the same steps (a rank that captures runs the step's collectives once more, in the warm-up
before the capture, than a rank that replays, and the two would wait on each other). A rank's time is the wall time of
`iters` steps back to back, synchronised at both ends; a row's is the slowest rank's.
`time_vs_one_rank`: the row's step time over one rank's; `vs_one_rank`, `vs_tp`: its tokens/s over
one rank's and over tensor parallelism's on as many ranks (`ranks.against_one_rank`).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import torch

import common
import ranks
import mla_func as mf
from mla_func.parallel import Parallel
from mla_func.parallel.data_parallel import plan_rank_step

BLOCK_SIZE = 64
# The MLA-family presets `bench/step.py` times; V4's step is `bench/v4_step.py`'s, its layer on several ranks
# `bench/layer.py --shape v4`'s (these plans give every cache group its table).
PRESETS = ("v2-lite", "v32-lite", "tiny")


def decode_plan(vocab: int, first: int, count: int, context: int, groups: Sequence[mf.CacheGroup],
                max_len: int) -> mf.StepPlan:
    """Sequences first .. first + count - 1 of a batch (their token ids follow that numbering, so every
    cut feeds the same tokens), each decoding its next token after `context` cached ones; in each cache
    group g of this rank's state (`groups`: one for MLA, V4's window and compressed ones) the i-th of them
    over blocks [1 + i * g.peak_blocks(max_len), ...), as many as its `context + 1` tokens' entries fill
    that a later step still reads: in a group with a lookback (V4's group 0) the blocks behind it are the
    scratch block, as the scheduler leaves them (`CacheGroup.first_live_block`)."""
    def table(group: mf.CacheGroup, i: int) -> tuple[int, ...]:
        start, first = 1 + i * group.peak_blocks(max_len), group.first_live_block(context)
        return (0,) * first + tuple(range(start, start + group.blocks_for(context + 1) - first))

    return mf.StepPlan(decode=tuple(
        mf.SeqPlan(((17 * (first + i)) % vocab,), context, table(groups[0], i), 1,
                   group_block_tables=tuple(table(g, i) for g in groups[1:]))
        for i in range(count)))


def _time(step: mf.Step, state: mf.KVCacheState, batch: mf.Batch, mode: mf.ForwardMode, iters: int,
          parallel: Parallel, device: torch.device) -> tuple[float, mf.KVCacheState, bool]:
    """(the slowest rank's ms a step over `iters` steps after 3 of warm-up, the state, whether it replayed
    a graph)."""
    for _ in range(3):
        state, out = step(state, batch, mode)
    ranks.synchronize(device)
    ranks.slowest(0.0, parallel, device)  # every rank starts its clock together
    started = time.perf_counter()
    for _ in range(iters):
        state, out = step(state, batch, mode)
    ranks.synchronize(device)
    ms = (time.perf_counter() - started) * 1e3 / iters
    return ranks.slowest(ms, parallel, device), state, out.graph


def decode_rows(model: mf.Model, mode: ranks.Mode, parallel: Parallel, device: torch.device, *,
                batches: list[int], contexts: list[int], iters: int, backend: str,
                kv_cache_dtype: str = "auto") -> list[dict]:
    """One rank's part of a mode: a cache of random latents for its sequences (`kv_cache_dtype` as
    `init_state` takes it), every (context, batch) row timed (the rows every rank returns alike: each
    holds the slowest rank's time)."""
    config = model.config
    ranks.slowest(0.0, parallel, device)  # the group's first collective, before any graph is captured
    count, rank = mode.ranks, parallel.rank
    split = mode.data_parallel_attention
    max_len = max(contexts) + 1
    own = [b // count if split else b for b in batches]  # sequences a rank runs, a batch
    most_seqs = max(own)
    blocks_per_seq = math.ceil(max_len / BLOCK_SIZE)
    # Sized as the engine sizes it for `most_seqs` decoding sequences: a group with a lookback (V4's window
    # and compressor inputs) holds only the blocks within it, which at 64K tokens is what makes V4 fit.
    state = mf.init_state(model, num_blocks=1 + most_seqs * blocks_per_seq, block_size=BLOCK_SIZE,
                          max_num_seqs=most_seqs, max_num_batched_tokens=most_seqs, kv_cache_dtype=kv_cache_dtype)
    ranks.fill_random_cache(state, kv_cache_dtype)
    step = mf.make_step(model, backend=backend, max_num_seqs=max(batches), max_model_len=max_len,
                        block_size=BLOCK_SIZE)
    rows = []
    for context in contexts:
        for batch, seqs in zip(batches, own):
            if split and (batch % count or not seqs):
                continue
            plans = [decode_plan(config.vocab_size, r * seqs if split else 0, seqs, context, state.groups, max_len)
                     for r in range(count)]
            if split:
                tensors, step_mode = plan_rank_step(config, state, plans, rank, backend=step.backend,
                                                    padding=step.padding, graphs=step.graphs,
                                                    max_position=model.max_positions)
            else:
                tensors, step_mode = step.prepare(state, plans[rank])
            ms, state, graph = _time(step, state, tensors, step_mode, iters, parallel, device)
            rows.append(dict(mode=mode.name, ranks=count, expert_parallel=mode.expert_parallel,
                             data_parallel_attention=split, batch=batch, context=context, rank_batch=seqs,
                             padded_batch=step_mode.padded_decode_seqs, graph=graph, graph_ms=ms,
                             graph_tok_s=batch / ms * 1e3))
            print({k: v for k, v in rows[-1].items() if k not in ("expert_parallel", "data_parallel_attention")},
                  flush=True)
    return rows


def rank_result(rows: list[dict], parallel: Parallel, device: torch.device) -> dict:
    """What a rank hands back: its rows, the most GPU memory any rank held (GB), and the device's names."""
    cuda = device.type == "cuda"
    peak_gb = ranks.slowest(torch.cuda.max_memory_allocated(device) / 1e9, parallel, device) if cuda else None
    return dict(rows=rows, peak_gb=peak_gb, gpu=common.gpu_name() if cuda else "cpu",
                device=common.gpu_slug() if cuda else "cpu")


def step_rank(args: argparse.Namespace, mode: ranks.Mode, parallel: Parallel, device: torch.device) -> dict:
    """One rank of `bench/step.py --tensor-parallel N`: its shard of the preset, then `decode_rows`."""
    model = ranks.random_shard(mf.PRESETS[args.preset](), parallel,
                               dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device,
                               max_model_len=max(args.contexts) + 1 + BLOCK_SIZE)
    rows = decode_rows(model, mode, parallel, device, batches=args.batches, contexts=args.contexts, iters=args.iters,
                       backend=args.backend)
    return rank_result(rows, parallel, device)


def run_modes(args: argparse.Namespace, bench: ranks.RankBench, codes: list[str]) -> tuple[list[dict], dict]:
    """Every mode in turn, each in a group of its own: (every row, compared with `against_one_rank`; the
    run's facts: the GPU's names and each mode's peak memory a rank)."""
    rows, peaks, found = [], {}, []
    for mode in ranks.modes(args.tensor_parallel, codes):
        print(f"== {mode.name}", flush=True)
        found.append(ranks.run_group(mode, bench, args, device_type=args.device))
        rows += found[-1]["rows"]
        peaks[mode.name] = found[-1]["peak_gb"]
    ranks.against_one_rank(rows, case=("batch", "context"), time_key="graph_ms", rate_key="graph_tok_s")
    return rows, dict(gpu=found[0]["gpu"], device=found[0]["device"], peak_gb=peaks)


def run(args: argparse.Namespace) -> None:
    """`bench/step.py --tensor-parallel N`: every mode, then the rows printed and written."""
    rows, facts = run_modes(args, step_rank, ranks.mode_codes(args))
    bench = "step-parallel" if args.preset == "v2-lite" else f"step-parallel-{args.preset}"
    result = dict(preset=args.preset, dtype="bfloat16" if args.device == "cuda" else "float32",
                  backend=args.backend, block_size=BLOCK_SIZE, commit=common.git_commit(args.commit),
                  tensor_parallel=args.tensor_parallel, weights="random", iters=args.iters, **facts, rows=rows)
    path = common.write_json(result, args.out, bench)
    print(f"\n{result['gpu']}, {args.preset}, peak GB a rank {facts['peak_gb']} -> {path}")
    print_rows(rows)
    print_figures(rows, args.tensor_parallel)


def print_rows(rows: list[dict], extra: tuple[tuple[str, str], ...] = ()) -> None:
    """The rows of a mode comparison as a table (`extra` columns after the step time)."""
    common.print_table(rows, [
        ("mode", "mode"), ("batch", "batch"), ("context", "ctx"), ("rank_batch", "a rank's"),
        ("graph", "graph"), ("graph_ms", "step ms"), *extra, ("graph_tok_s", "tok/s"),
        ("time_vs_one_rank", "time x 1 rank"), ("vs_one_rank", "tok/s x 1 rank"), ("vs_tp", "tok/s x TP"),
    ])


def print_figures(rows: list[dict], count: int) -> None:
    """The figures the targets read (bench/report.py): batch 1's step time and batch 64's and 256's
    tokens/s on N ranks over one rank's, and data-parallel attention over tensor parallelism."""
    tp = f"TP {count}"
    for row in rows:
        if row["mode"] == tp and row["batch"] == 1 and "time_vs_one_rank" in row:
            print(f"{tp}, batch 1, context {row['context']}: step time {row['time_vs_one_rank']:.2f} x one "
                  f"rank's (target <= 0.6)")
        if row["mode"] == tp and row["batch"] in (64, 256) and "vs_one_rank" in row:
            print(f"{tp}, batch {row['batch']}, context {row['context']}: tokens/s {row['vs_one_rank']:.2f} x one "
                  f"rank's (target >= 1.6)")
        if row["data_parallel_attention"] and row["batch"] == 256 and "vs_tp" in row:
            print(f"{row['mode']}, batch 256, context {row['context']}: tokens/s {row['vs_tp']:.2f} x {tp}'s")
