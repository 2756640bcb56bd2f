"""Offline throughput of the "v2-lite" preset against transformers' batched generate, same requests, same GPU.

    python bench/throughput.py [--num-prompts 256] [--min-input-len 128] [--max-input-len 1024]
                               [--output-len 256] [--hf-prompts 256] [--commit SHA]

Random bf16 weights; prompts of uniform random length; greedy decoding with no
early stop, so every request generates exactly --output-len tokens. mla-func runs
twice, batch-invariant (`Engine(batch_invariant=True)`) and not; "invariant cost" is the
default mode's output tokens/s over the batch-invariant one's, less 1. Prints a
table and writes JSON under bench/results/.

    python bench/throughput.py --fp8

runs the engine over bf16 weights, over block-scaled FP8 weights (`load_model(quantization="fp8")`, random
weights quantized in 128 x 128 blocks) and over FP8 weights with w8a8 steps (`Engine(w8a8=True)`), same requests, and writes
`throughput-fp8` results (each run's output tokens/s over the bf16 run's; transformers does not run).

    python bench/throughput.py --tensor-parallel 2 [--expert-parallel] [--data-parallel-attention]

runs the engine on one rank and on N ranks of this host (one GPU each) in the same run, same requests
and random weights, and writes `throughput-parallel` results instead (`bench/throughput_parallel.py`;
neither the batch-invariant mode nor transformers runs then; `--data-parallel-attention` adds N ranks attending
for their own requests; `--device cpu --preset tiny` runs it on
the CPU over gloo, for a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ranks  # noqa: E402
import throughput_parallel  # noqa: E402

import mla_func as mf  # noqa: E402
from mla_func.serving.benchmark import random_requests, run_throughput  # noqa: E402


def transformers_throughput(config: mf.ModelConfig, prompts: list[list[int]], output_len: int, batch: int) -> dict:
    """transformers' DeepseekV3ForCausalLM.generate over `prompts`, `batch` at a time, left-padded."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_config = DeepseekV3Config(**{**config.to_hf_dict(), "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(hf_config).to(torch.bfloat16).eval()
    outputs = 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device="cuda")
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0)
        outputs += (out.shape[1] - width) * len(group)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    prompt_tokens = sum(len(p) for p in prompts)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return dict(num_prompts=len(prompts), prompt_tokens=prompt_tokens, output_tokens=outputs, seconds=seconds,
                output_tok_s=outputs / seconds, total_tok_s=(outputs + prompt_tokens) / seconds, batch=batch)


def fp8_run(args: argparse.Namespace) -> None:
    """`--fp8`: bf16 weights, FP8 weights, FP8 weights with w8a8 steps; the same requests in one process."""
    rows = []
    for engine, quantization, w8a8 in (("bf16", None, False), ("fp8", "fp8", False), ("fp8 w8a8", "fp8", True)):
        model = mf.load_model("v2-lite", dtype=torch.bfloat16, device="cuda", quantization=quantization)
        run = run_throughput(
            model, num_prompts=args.num_prompts, input_len=(args.min_input_len, args.max_input_len),
            output_len=args.output_len, backend=args.backend, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, w8a8=w8a8,
        )
        print(f"mla-func ({engine} weights):", run, flush=True)
        rows.append(dict(engine=engine, **run))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    for row in rows:
        row["vs_bf16"] = row["output_tok_s"] / rows[0]["output_tok_s"]
    write_result(args, "throughput-fp8", rows, [("engine", "weights"), *COUNTS, ("vs_bf16", "x bf16")])


# The columns every throughput table prints after its first.
COUNTS = [("num_prompts", "requests"), ("prompt_tokens", "prompt tok"), ("output_tokens", "output tok"),
          ("seconds", "s"), ("output_tok_s", "output tok/s"), ("total_tok_s", "total tok/s")]


def write_result(args: argparse.Namespace, benchmark: str, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """The run's JSON under bench/results/<benchmark>/, and its table."""
    result = dict(
        benchmark=benchmark, preset="v2-lite", dtype="bfloat16", backend=args.backend,
        gpu=common.gpu_name(), device=common.gpu_slug(), date=common.today(), commit=common.git_commit(args.commit),
        torch=torch.__version__, output_len=args.output_len, input_len=[args.min_input_len, args.max_input_len],
        rows=rows,
    )
    path = common.write_json(result, args.out, benchmark)
    print(f"\n{result['gpu']} -> {path}")
    common.print_table(rows, columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=128)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--hf-prompts", type=int, default=256, help="how many of the same requests transformers runs")
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--backend", default=None, help="default triton on cuda, torch on cpu")
    parser.add_argument("--preset", default="v2-lite", choices=["v2-lite", "tiny"],
                        help="tiny: the small preset, for a smoke test of --tensor-parallel")
    ranks.add_arguments(parser)
    parser.add_argument("--fp8", action="store_true",
                        help="bf16 weights against FP8 weights, with and without w8a8 steps (throughput-fp8 results)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    several = ranks.check_arguments(parser, args)
    if not several and args.preset != "v2-lite":
        parser.error(f"--preset {args.preset}: the one-GPU run measures v2-lite; other presets need --tensor-parallel N")
    if several:
        throughput_parallel.run(args)
        return
    if args.fp8:
        fp8_run(args)
        return

    model = mf.load_model("v2-lite", dtype=torch.bfloat16, device="cuda")
    # Both modes on the same requests, one after the other in this process: the
    # batch-invariant cost is their ratio.
    runs = {}
    for invariant in (False, True):
        runs[invariant] = run_throughput(
            model, num_prompts=args.num_prompts, input_len=(args.min_input_len, args.max_input_len),
            output_len=args.output_len, backend=args.backend, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
            batch_invariant=invariant,
        )
        print(f"mla-func (batch_invariant={invariant}):", runs[invariant], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    config = model.config
    del model
    gc.collect()
    torch.cuda.empty_cache()
    ours = runs[False]
    rows = [dict(engine="mla-func batch-invariant", **runs[True],
                 invariant_cost=runs[False]["output_tok_s"] / runs[True]["output_tok_s"] - 1),
            dict(engine="mla-func", **runs[False])]
    if args.hf_prompts:
        prompts = random_requests(config.vocab_size, args.num_prompts, (args.min_input_len, args.max_input_len), 0)
        hf = transformers_throughput(config, prompts[: args.hf_prompts], args.output_len, args.hf_batch)
        print("transformers:", hf, flush=True)
        rows.append(dict(engine="transformers", **hf))
        rows[0]["vs_transformers"] = ours["output_tok_s"] / hf["output_tok_s"]
    write_result(args, "throughput", rows, [("engine", "engine"), *COUNTS, ("vs_transformers", "x transformers"),
                                            ("invariant_cost", "invariant cost")])


if __name__ == "__main__":
    main()
