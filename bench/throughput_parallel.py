"""The engine's offline throughput on several ranks against one rank, same requests, same weights:
`bench/throughput.py --tensor-parallel N`.

Each mode runs in a group of fresh processes of its own (`ranks.run_group`): one rank first, then N
ranks tensor-parallel (and with --expert-parallel, N ranks holding whole experts). Every rank draws
the same random weights and keeps its shard (`ranks.random_shard`), and runs the same engine over the
same requests (`serving.benchmark.run_throughput`): the engine's scheduler decides alike on every
rank, and sampling reads logits every rank holds whole, so the ranks step together. With
--data-parallel-attention also N ranks attending for their own requests (each rank's engine runs every
rank's schedulers and returns every completion, `serving.rank_scheduler`). Rank 0's figures are the mode's.
"""

from __future__ import annotations

import argparse

import torch

import common
import ranks
import mla_func as mf
from mla_func.parallel import Parallel
from mla_func.serving.benchmark import run_throughput


def throughput_rank(args: argparse.Namespace, mode: ranks.Mode, parallel: Parallel, device: torch.device) -> dict:
    """One rank's engine over the benchmark's requests; rank 0's result is the mode's."""
    cuda = device.type == "cuda"
    longest = args.max_input_len + args.output_len
    model = ranks.random_shard(mf.PRESETS[args.preset](), parallel, dtype=torch.bfloat16 if cuda else torch.float32,
                               device=device, max_model_len=longest + args.block_size)
    speaks = parallel.rank == 0

    def say(message: str) -> None:
        if speaks:
            print(f"[{mode.name}] {message}", flush=True)

    result = run_throughput(
        model, num_prompts=args.num_prompts, input_len=(args.min_input_len, args.max_input_len),
        output_len=args.output_len, backend=args.backend, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, progress=speaks and cuda,
        say=say)
    say(str(result))
    return dict(row=dict(mode=mode.name, ranks=mode.ranks, expert_parallel=mode.expert_parallel,
                         data_parallel_attention=mode.data_parallel_attention, **result),
                gpu=common.gpu_name() if cuda else "cpu", device=common.gpu_slug() if cuda else "cpu")


def run(args: argparse.Namespace) -> None:
    """One rank, then N ranks each way asked; the rows compared, printed and written."""
    found = [ranks.run_group(mode, throughput_rank, args, device_type=args.device)
             for mode in ranks.modes(args.tensor_parallel, ranks.mode_codes(args))]
    rows = [result["row"] for result in found]
    ranks.against_one_rank(rows, case=(), time_key="seconds", rate_key="output_tok_s")
    result = dict(preset=args.preset, dtype="bfloat16" if args.device == "cuda" else "float32",
                  backend=args.backend, gpu=found[0]["gpu"], device=found[0]["device"],
                  commit=common.git_commit(args.commit), tensor_parallel=args.tensor_parallel, weights="random",
                  output_len=args.output_len, input_len=[args.min_input_len, args.max_input_len], rows=rows)
    bench = "throughput-parallel" if args.preset == "v2-lite" else f"throughput-parallel-{args.preset}"
    path = common.write_json(result, args.out, bench)
    print(f"\n{result['gpu']}, {args.preset} -> {path}")
    common.print_table(rows, [
        ("mode", "mode"), ("num_prompts", "requests"), ("output_tokens", "output tok"), ("seconds", "s"),
        ("output_tok_s", "output tok/s"), ("total_tok_s", "total tok/s"), ("itl_ms_p50", "ITL p50 ms"),
        ("vs_one_rank", "x 1 rank"), ("vs_tp", "x TP"),
    ])
