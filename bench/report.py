"""Write bench/RESULTS.md from the result files under bench/results/.

    python bench/report.py [--out bench/RESULTS.md]

Each result file is `bench/results/<bench>/<device>/<date>-<commit7>[-n].json`. For each benchmark
and device the page shows the latest file (by date, then by the commit order of `git log`, then n);
a case that file did not measure is taken from the latest file that did, with its own commit. A
target's figure is the latest measurement of it. Targets are declared once, in TARGETS below.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
NAME = re.compile(r"^(\d{4}-\d\d-\d\d)-([0-9a-f]{7}|unknown)(?:-(\d+))?\.json$")

# Old key names -> the schema's (see common.SCHEMA); files are read through this, never rewritten.
ALIASES = {"gpu_slug": "device", "cases": "rows", "copy_bandwidth_GBps": "copy_bandwidth_gb_s",
           "bf16_matmul_TFLOPs": "bf16_matmul_tflop_s", "GBps": "gb_s", "TFLOPs": "tflop_s",
           "kernel_TFLOPs": "kernel_tflop_s", "topk_GBps_one_pass": "topk_gb_s_one_pass"}

# table: (title, row list, rows shown (None: all; else each a dict the row must match), columns). A table is
# named by its bench (the folder under results/), or "<bench>:<name>" for a second table of the same files.
# A column is (header, key, format); `us` is derived from `ms`, `roofline_ratio` from graph_ms / roofline_ms.
BENCHES = {
    "kernels": ("MLA decode, MoE and prefill kernels (`bench/kernels.py`)", "rows",
                [dict(op="mla_decode", batch=128, context=4096, heads=16), dict(op="fused_moe", tokens=1),
                 dict(op="prefill_attention")],
                [("µs", "us", "{:.1f}"), ("% copy", "pct_copy", "{:.1f}"), ("% bf16 mm", "pct_matmul", "{:.1f}"),
                 ("t / t_copy", "copy_time_ratio", "{:.2f}")]),
    "dsa-kernels": ("DeepSeek-V3.2 sparse attention kernels (`bench/dsa_kernels.py`)", "rows",
                    [dict(op="index_topk", batch=64, context=131072), dict(op="dsa_decode", batch=64, context=32768),
                     dict(op="dsa_decode", batch=64, context=131072), dict(op="dsa_decode", batch=8, context=131072)],
                    [("µs", "us", "{:.0f}"), ("roofline µs", "roofline_ms", "{:.0f}", 1e3),
                     ("t / t_copy", "copy_time_ratio", "{:.2f}"), ("% copy", "pct_copy", "{:.1f}")]),
    "v4-kernels": ("DeepSeek-V4 kernels (`bench/v4_kernels.py`)", "rows",
                   [dict(op=op, batch=64, context=65536)
                    for op in ("csa_decode", "hca_attention", "hca_attention_fp8", "csa_attention_fp8")]
                   + [dict(op=op, batch=128, context=65536) for op in ("csa_decode", "hca_attention")],
                   [("µs", "us", "{:.0f}"), ("t / t_copy", "copy_time_ratio", "{:.2f}"), ("% copy", "pct_copy", "{:.1f}"),
                    ("bf16 / FP8 cache", "bf16_over_fp8", "{:.2f}")]),
    "v4-attention-ceiling": ("V4 attention: the best `tl.dot` loop (`bench/v4_attention_ceiling.py`)", "rows", None,
                             [("roofline µs", "roofline_us", "{:.1f}"), ("ideal loop µs", "ideal_us", "{:.1f}"),
                              ("ideal t / t_copy", "ideal_ratio", "{:.2f}"), ("ours t / t_copy", "ours_ratio", "{:.2f}")]),
    "v4-step": ("DeepSeek-V4 decode step, v4-mini (`bench/v4_step.py`)", "rows",
                [dict(batch=1, context=c) for c in (8192, 65536, 262144, 1048574)] + [dict(batch=64, context=65536)],
                [("graph ms", "graph_ms", "{:.2f}"), ("× roofline", "roofline_ratio", "{:.2f}"),
                 ("% roofline", "pct_roofline", "{:.1f}"), ("tok/s", "graph_tok_s", "{:.0f}"),
                 ("batch-invariant cost", "invariant_cost", "{:+.1%}")]),
    "v4-step-fp8": ("DeepSeek-V4 decode step, v4-mini, over bf16 and FP8 caches, one run (`bench/v4_step.py --fp8-cache`)",
                    "rows", None,
                    [("graph ms", "graph_ms", "{:.2f}"), ("× roofline", "roofline_ratio", "{:.2f}"),
                     ("× bf16 cache", "vs_bf16", "{:.2f}"), ("cache GB", "cache_gb", "{:.3f}")]),
    "step": ("Decode step, v2-lite (`bench/step.py`)", "rows",
             [dict(batch=1, context=1024), dict(batch=64, context=4096), dict(batch=256, context=4096),
              dict(batch=64, context=32768), dict(batch=8, context=131072)],
             [("graph ms", "graph_ms", "{:.2f}"), ("% roofline", "pct_roofline", "{:.1f}"),
              ("tok/s", "graph_tok_s", "{:.0f}"), ("batch-invariant cost", "invariant_cost", "{:+.1%}"),
              ("× transformers", "vs_hf", "{:.1f}")]),
    "step-fp8": ("Decode step, v2-lite with block-scaled FP8 weights (and the FP8 latent cache) against bf16, one run "
                 "(`bench/step.py --fp8`)", "rows", None,
                 [("graph ms", "graph_ms", "{:.3f}"), ("× roofline", "roofline_ratio", "{:.2f}"),
                  ("× bf16 step", "vs_bf16", "{:.2f}"), ("weight GB", "weight_gb", "{:.2f}")]),
    "step-parallel": ("Decode step on several GPUs against one, v2-lite, same random weights, one run (`bench/step.py "
                      "--tensor-parallel 2 --expert-parallel --data-parallel-attention`)", "rows", None,
                      [("step ms", "graph_ms", "{:.2f}"), ("tok/s", "graph_tok_s", "{:.0f}"),
                       ("time × 1 GPU", "time_vs_one_rank", "{:.2f}"), ("tok/s × 1 GPU", "vs_one_rank", "{:.2f}"),
                       ("tok/s × TP", "vs_tp", "{:.2f}")]),
    "layer": ("DeepSeek-V3's layer at its real size, random bf16 weights, on one GPU and on several "
              "(`bench/layer.py`)", "rows", None,
              [("ms / layer", "layer_ms", "{:.3f}"), ("tok/s", "graph_tok_s", "{:.0f}"),
               ("time × 1 GPU", "time_vs_one_rank", "{:.2f}"), ("tok/s × TP", "vs_tp", "{:.2f}")]),
    "layer-fp8": ("DeepSeek-V3's layer at its real size, random weights as block-scaled FP8 pairs (DeepSeek's released "
                  "layout) with the bf16 or the FP8 latent cache, on one GPU and on several (`bench/layer.py --fp8 "
                  "[--kv-cache-dtype fp8]`)", "rows", None,
                  [("ms / layer", "layer_ms", "{:.3f}"), ("tok/s", "graph_tok_s", "{:.0f}"),
                   ("time × 1 GPU", "time_vs_one_rank", "{:.2f}"), ("tok/s × TP", "vs_tp", "{:.2f}")]),
    "layer-fp8-v4": ("DeepSeek-V4-Flash's layer at its real size, FP8 linears and FP4 routed experts as released, random "
                     "weights, on one GPU and on several (`bench/layer.py --shape v4 --fp8`)", "rows", None,
                     [("ms / layer", "layer_ms", "{:.3f}"), ("tok/s", "graph_tok_s", "{:.0f}"),
                      ("time × 1 GPU", "time_vs_one_rank", "{:.2f}"), ("tok/s × TP", "vs_tp", "{:.2f}")]),
    "step-v32-lite": ("Decode step, v32-lite (`bench/step.py --preset v32-lite`)", "rows", None,
                      [("graph ms", "graph_ms", "{:.2f}"), ("% roofline", "pct_roofline", "{:.1f}"),
                       ("tok/s", "graph_tok_s", "{:.0f}")]),
    "speculative": ("Speculative decoding, verify step against decode (`bench/speculative.py`)", "verify_rows",
                    [dict(batch=b, step="verify k=1") for b in (1, 32)],
                    [("ms", "ms", "{:.2f}"), ("× decode", "x_decode", "{:.2f}"),
                     ("roofline × decode's", "roofline_x_decode", "{:.2f}")]),
    "speculative:match": ("Speculative decoding: requests keeping k = 0's tokens, demo model, 8 random prompts "
                          "(`bench/speculative.py --match`; every batch and k in the result file)", "token_match_rows",
                          [dict(mode=m, batch=8) for m in ("default", "batch-invariant")]
                          + [dict(mode=m, batch=1, k=3) for m in ("default", "batch-invariant")],
                          [("same tokens", "matched", "{}"), ("of", "requests", "{}"),
                           ("tok/s", "output_tok_s", "{:.0f}"), ("acceptance", "acceptance_rate", "{:.2f}"),
                           ("target ms / iter", "target_ms_per_iteration", "{:.3f}"),
                           ("drafter ms / iter", "drafter_ms_per_iteration", "{:.3f}"),
                           ("host and rest ms / iter", "rest_ms_per_iteration", "{:.3f}")]),
    "speculative:speedup": ("Speculative decoding: estimated decode speed-up on v2-lite's measured steps "
                            "(`bench/speculative.py`)", "estimated_speedup_rows", None,
                            [("acceptance rate", "acceptance_rate", "{:.2f}"), ("tokens / iter", "tokens_per_iteration",
                                                                               "{:.2f}"),
                             ("iteration × decode", "iteration_x_decode", "{:.2f}"), ("speed-up", "speedup", "{:.2f}")]),
    "kernels:fp8": ("Block-scaled FP8 linear and MoE kernels, DeepSeek-V3's shapes (`bench/kernels.py --fp8`)", "rows",
                    [dict(op="fp8_gemm", tokens=t, n=n, k=7168, w8a8=True) for t in (1024, 4096) for n in (7168, 18432)]
                    + [dict(op="fp8_gemm", tokens=1024, n=n, k=7168, w8a8=False) for n in (7168, 18432)]
                    + [dict(op="fp8_linear", tokens=t, n=7168, k=7168, w8a8=w) for t in (1, 16) for w in (False, True)]
                    + [dict(op="fp8_moe", tokens=t, w8a8=w) for t in (1, 16, 1024) for w in (False, True)],
                    [("µs", "us", "{:.1f}"), ("TFLOP/s", "tflop_s", "{:.0f}"), ("% copy", "pct_copy", "{:.1f}")]),
    "kernels:fp4": ("V4's FP4 routed experts read packed in the kernel, V4-Flash's shapes (`bench/kernels.py --fp4`)",
                    "rows", [dict(op="fp4_experts", tokens=t, experts=256) for t in (1, 16, 64, 256)]
                    + [dict(op="fp4_experts", tokens=t, experts=32) for t in (64, 128)],
                    [("µs", "us", "{:.1f}"), ("% copy", "pct_copy", "{:.1f}"), ("TFLOP/s", "tflop_s", "{:.1f}")]),
    "kernels:wgmma": ("MLA decode at 128 heads on Hopper's warpgroup MMA (Gluon) beside its `tl.dot` twin, same run "
                      "(`bench/kernels.py --wgmma`)", "rows",
                      [dict(op="mla_decode", heads=128, batch=b, context=c, q_len=1, kernel=k)
                       for b, c in ((64, 4096), (64, 32768), (128, 32768)) for k in ("wgmma", "chunks")]
                      + [dict(op="mla_decode", heads=128, batch=64, context=4096, q_len=n, kernel=k)
                         for n in (2, 3, 4) for k in ("wgmma", "rows")],
                      [("µs", "us", "{:.0f}"), ("TFLOP/s", "tflop_s", "{:.0f}"), ("% bf16 mm", "pct_matmul", "{:.1f}"),
                       ("× twin", "speedup_vs_twin", "{:.2f}")]),
    "dsa-kernels:wgmma": ("V3.2's sparse MLA decode and prefill (one 32K sequence's last T tokens) at 128 heads, "
                          "top-2048, on Hopper's warpgroup MMA beside its `tl.dot` twin, same run "
                          "(`bench/dsa_kernels.py --wgmma`)", "rows",
                          [dict(op="sparse_mla_decode", heads=128, batch=b, kernel=k)
                           for b in (64, 128) for k in ("wgmma", "tl.dot")]
                          + [dict(op="sparse_mla_prefill", heads=128, tokens=t, kernel=k)
                             for t in (1024, 4096) for k in ("wgmma", "tl.dot")],
                          [("µs", "us", "{:.0f}"), ("TFLOP/s", "tflop_s", "{:.0f}"), ("% bf16 mm", "pct_matmul", "{:.1f}"),
                           ("t / t_copy", "copy_time_ratio", "{:.2f}"), ("× twin", "speedup_vs_twin", "{:.2f}")]),
    "dsa-kernels:narrow": ("V3.2's sparse MLA decode at 16 heads, top-2048, B64: the keys-as-rows kernel on Hopper's "
                           "warpgroup MMA beside its `tl.dot` twin, same run (`bench/dsa_kernels.py`)", "rows",
                           [dict(op="sparse_mla_decode", heads=16, batch=64, context=c, kernel=k)
                            for c in (32768, 131072) for k in ("narrow", "tl.dot")],
                           [("µs", "us", "{:.1f}"), ("t / t_copy", "copy_time_ratio", "{:.2f}"),
                            ("% copy", "pct_copy", "{:.1f}"), ("× twin", "speedup_vs_twin", "{:.2f}")]),
    "kernels:fp8-cache": ("MLA decode over the FP8 latent cache against the bf16 cache, same run "
                          "(`bench/kernels.py --fp8-cache`)", "rows",
                          [dict(op="mla_decode", batch=64, context=32768, heads=h, cache="fp8") for h in (16, 128)],
                          [("µs", "us", "{:.0f}"), ("% copy", "pct_copy", "{:.1f}"), ("TFLOP/s", "tflop_s", "{:.0f}"),
                           ("× faster than bf16 cache", "bf16_over_fp8", "{:.2f}")]),
    "serve": ("OpenAI server under open-loop load against the offline engine, v2-lite (`bench/serve.py`)", "rows", None,
              [("output tok/s", "output_tok_s", "{:.0f}"), ("TTFT p50 ms", "ttft_ms_p50", "{:.0f}"),
               ("TTFT p99 ms", "ttft_ms_p99", "{:.0f}"), ("ITL p50 ms", "itl_ms_p50", "{:.1f}"),
               ("ITL p99 ms", "itl_ms_p99", "{:.1f}"), ("× offline", "vs_offline", "{:.2f}"),
               ("µs / token over offline", "overhead_us_per_token", "{:.1f}")]),
    "throughput": ("Engine throughput, v2-lite (`bench/throughput.py`)", "rows", None,
                   [("seconds", "seconds", "{:.2f}"), ("output tok/s", "output_tok_s", "{:.0f}"),
                    ("× transformers", "vs_transformers", "{:.1f}"), ("batch-invariant cost", "invariant_cost", "{:+.1%}")]),
    "throughput-fp8": ("Engine throughput, v2-lite with block-scaled FP8 weights (with and without w8a8 steps) "
                       "against bf16, same requests (`bench/throughput.py --fp8`)", "rows", None,
                       [("seconds", "seconds", "{:.2f}"), ("output tok/s", "output_tok_s", "{:.0f}"),
                        ("total tok/s", "total_tok_s", "{:.0f}"), ("× bf16", "vs_bf16", "{:.2f}")]),
    "throughput-parallel": ("Engine throughput on several GPUs against one, v2-lite, same random weights and "
                            "requests (`bench/throughput.py --tensor-parallel 2 [--expert-parallel] [--data-parallel-attention]`)", "rows", None,
                            [("seconds", "seconds", "{:.2f}"), ("output tok/s", "output_tok_s", "{:.0f}"),
                             ("× 1 GPU", "vs_one_rank", "{:.2f}"), ("× TP", "vs_tp", "{:.2f}")]),
    "throughput-compare": ("Engine throughput, a new commit against d1e17d9's, processes alternating on one GPU "
                           "(`bench/notes/throughput.md`)", "rows", None,
                           [("output tok/s", "output_tok_s", "{:.0f}"), ("× d1e17d9", "vs_d1e17d9", "{:.3f}")]),
    "soak": ("Soak, v2-lite engine (`bench/soak.py`)", "rows",
             [dict(what=w) for w in ("requests", "unexpected exceptions", "leaked blocks", "non-finite logits rows")],
             [("count", "count", "{}")]),
    "cache-budget": ("Cache bytes a token, bf16, blocks of 16 (`bench/cache_budget.py`: arithmetic on the cache "
                     "groups; 64 GiB of cache for the last two columns)", "rows", None,
                     [("B/token 8K", "bytes_per_token_8k", "{:,.0f}"), ("B/token 64K", "bytes_per_token_64k", "{:,.0f}"),
                      ("B/token 1M", "bytes_per_token_1024k", "{:,.0f}"),
                      ("longest context", "longest_context_in_budget", "{:,}"),
                      ("64K sequences", "seqs_of_64k_in_budget", "{:,}")]),
    "cpu": ("CPU, demo model (`bench/cpu.py`)", "rows", None,
            [("stream tok/s", "stream_tok_s", "{:.0f}"), ("beside a busy process", "stream_busy_tok_s", "{:.0f}"),
             ("bench out tok/s", "bench_output_tok_s", "{:.0f}"), ("score 2048 s", "score_tiny_2048_s", "{:.2f}")]),
}

# (bench, row, figure, comparison, threshold, the issue that set it)
TARGETS = [
    ("kernels", dict(op="mla_decode", batch=128, context=4096, heads=16), "pct_copy", ">=", 85, "Triton kernels"),
    ("kernels", dict(op="fused_moe", tokens=1), "copy_time_ratio", "<=", 1.3, "Triton kernels"),
    ("kernels", dict(op="prefill_attention"), "pct_matmul", ">=", 50, "Triton kernels"),
    ("step", dict(batch=1, context=1024), "roofline_ratio", "<=", 1.5, "decode step"),
    ("step", dict(batch=1, context=1024), "graph_speedup", ">=", 4, "decode step"),
    ("step", dict(batch=1, context=1024), "vs_hf", ">=", 50, "decode step"),
    ("step", dict(batch=64, context=4096), "pct_roofline", ">=", 70, "decode step"),
    ("step", dict(batch=256, context=4096), "pct_roofline", ">=", 70, "decode step"),
    ("throughput", dict(engine="mla-func"), "vs_transformers", ">=", 20, "engine"),
    ("step-parallel", dict(mode="TP 2", batch=1, context=1024), "time_vs_one_rank", "<=", 0.6, "several GPUs"),
    ("step-parallel", dict(mode="TP 2", batch=64, context=4096), "vs_one_rank", ">=", 1.6, "several GPUs"),
    ("step-parallel", dict(mode="TP 2", batch=256, context=4096), "vs_one_rank", ">=", 1.6, "several GPUs"),
    ("step", dict(batch=1, context=1024), "invariant_cost", "<=", 0.10, "batch invariance"),
    ("step-fp8", dict(batch=1, context=1024, run="fp8 weights, bf16 cache"), "vs_bf16", "<=", 0.6, "FP8 checkpoints"),
    ("step-fp8", dict(batch=1, context=1024, run="fp8 weights, bf16 cache"), "roofline_ratio", "<=", 1.3,
     "FP8 checkpoints"),
    ("throughput", dict(engine="mla-func batch-invariant"), "invariant_cost", "<=", 0.10, "batch invariance"),
    ("throughput-compare", dict(run="median", role="new"), "vs_d1e17d9", ">=", 1.0, "one seam per family"),
    ("dsa-kernels", dict(op="index_topk", batch=64, context=131072), "pct_copy", ">=", 60, "DSA"),
    ("dsa-kernels", dict(op="dsa_decode", batch=64, context=32768), "copy_time_ratio", "<=", 1.3, "DSA"),
    ("dsa-kernels", dict(op="dsa_decode", batch=64, context=131072), "copy_time_ratio", "<=", 1.3, "DSA"),
    ("step-v32-lite", dict(batch=64, context=32768), "pct_roofline", ">=", 70, "DSA"),
    ("step-v32-lite", dict(batch=8, context=131072), "pct_roofline", ">=", 70, "DSA"),
    ("v4-kernels", dict(op="csa_decode", batch=64, context=65536), "copy_time_ratio", "<=", 1.3, "DeepSeek-V4"),
    ("v4-kernels", dict(op="hca_attention", batch=64, context=65536), "copy_time_ratio", "<=", 1.3, "DeepSeek-V4"),
    ("v4-step", dict(batch=1, context=65536), "roofline_ratio", "<=", 1.5, "DeepSeek-V4"),
    ("v4-step", dict(batch=64, context=65536), "pct_roofline", ">=", 70, "DeepSeek-V4"),
    ("v4-step", dict(batch=64, context=65536), "graph_ms", "<=", 2.40, "V4 at long context"),
    ("speculative", dict(batch=1, step="verify k=1"), "x_decode", "<=", 1.15, "MTP speculative decoding"),
    ("speculative", dict(batch=32, step="verify k=1"), "x_decode", "<=", 1.3, "MTP speculative decoding"),
    ("speculative:match", dict(mode="batch-invariant", batch=8, k=3), "matched", ">=", 8, "promises hold"),
    ("speculative:match", dict(mode="batch-invariant", batch=1, k=3), "matched", ">=", 8, "promises hold"),
    ("soak", dict(what="unexpected exceptions"), "count", "<=", 0, "soak"),
    ("soak", dict(what="leaked blocks"), "count", "<=", 0, "soak"),
    ("kernels:fp8-cache", dict(op="mla_decode", batch=64, context=32768, heads=16, cache="fp8"), "bf16_over_fp8",
     ">=", 1.6, "FP8 checkpoints"),
    ("kernels:fp8-cache", dict(op="mla_decode", batch=64, context=32768, heads=128, cache="fp8"), "bf16_over_fp8",
     ">=", 1.6, "FP8 checkpoints"),
    ("kernels:fp8", dict(op="fp8_gemm", tokens=1024, n=7168, k=7168, w8a8=True), "tflop_s", ">=", 350,
     "FP8 checkpoints"),
    ("kernels:fp8", dict(op="fp8_gemm", tokens=4096, n=18432, k=7168, w8a8=True), "tflop_s", ">=", 350,
     "FP8 checkpoints"),
    ("kernels:fp8", dict(op="fp8_linear", tokens=1, n=7168, k=7168, w8a8=False), "pct_copy", ">=", 80,
     "FP8 checkpoints"),
    ("kernels:fp8", dict(op="fp8_linear", tokens=16, n=18432, k=7168, w8a8=False), "pct_copy", ">=", 80,
     "FP8 checkpoints"),
    ("kernels:fp8", dict(op="fp8_moe", tokens=1, w8a8=False), "pct_copy", ">=", 80, "FP8 checkpoints"),
    ("kernels:fp8", dict(op="fp8_moe", tokens=16, w8a8=False), "pct_copy", ">=", 80, "FP8 checkpoints"),
    ("serve", dict(run="server inf req/s"), "vs_offline", ">=", 0.9, "OpenAI server"),
    ("kernels", dict(op="mla_decode", batch=128, context=4096, heads=16), "pct_copy", ">=", 92, "Hopper kernels"),
    ("kernels:wgmma", dict(op="mla_decode", heads=128, batch=64, context=4096, q_len=1, kernel="wgmma"), "tflop_s",
     ">=", 350, "Hopper kernels"),
    ("kernels:wgmma", dict(op="mla_decode", heads=128, batch=128, context=32768, q_len=1, kernel="wgmma"), "tflop_s",
     ">=", 350, "Hopper kernels"),
    ("kernels:wgmma", dict(op="mla_decode", heads=128, batch=64, context=4096, q_len=3, kernel="wgmma"), "tflop_s",
     ">=", 350, "Hopper kernels"),
    ("dsa-kernels:wgmma", dict(op="sparse_mla_decode", heads=128, batch=64, kernel="wgmma"), "tflop_s", ">=", 350,
     "Hopper kernels"),
    ("dsa-kernels:wgmma", dict(op="sparse_mla_decode", heads=128, batch=128, kernel="wgmma"), "tflop_s", ">=", 350,
     "Hopper kernels"),
    ("dsa-kernels:wgmma", dict(op="sparse_mla_prefill", heads=128, tokens=4096, kernel="wgmma"), "pct_matmul", ">=",
     50, "Hopper kernels"),
    ("cpu", dict(threads=1), "stream_busy_tok_s", ">=", 200, "CPU"),
    ("cpu", dict(threads=1), "score_tiny_2048_s", "<", 1, "CPU"),
]
COMPARE = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b}
SIGN = {"<=": "≤", "<": "<", ">=": "≥"}


def commit_order() -> dict[str, int]:
    """Short commit -> its place in `git log`, newest highest; empty where git is not available."""
    try:
        out = subprocess.run(["git", "log", "--format=%H"], capture_output=True, text=True, cwd=BENCH, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    hashes = out.stdout.split() if out.returncode == 0 else []
    return {h[:7]: len(hashes) - i for i, h in enumerate(hashes)}


def normalise(value):
    """A result read through ALIASES, with the rows' derived figures filled in."""
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if not isinstance(value, dict):
        return value
    d = {ALIASES.get(k, k): normalise(v) for k, v in value.items()}
    if "ms" in d and "us" not in d:
        d["us"] = d["ms"] * 1e3
    if "roofline_ratio" not in d and d.get("graph_ms") and d.get("roofline_ms"):
        d["roofline_ratio"] = d["graph_ms"] / d["roofline_ms"]
    if "rows" not in d and isinstance(d.get("counts"), dict):   # soak files before `rows`
        d["rows"] = [dict(what=k, count=v) for k, v in d["counts"].items()]
    return d


def load(results: Path = RESULTS) -> dict[tuple[str, str], list[dict]]:
    """(bench, device) -> its results, newest first; each with `_path`."""
    order = commit_order()
    found: dict[tuple[str, str], list[tuple]] = {}
    for path in results.glob("*/*/*.json"):
        match = NAME.match(path.name)
        if not match:
            continue
        date, commit, n = match.group(1), match.group(2), int(match.group(3) or 1)
        result = normalise(json.loads(path.read_text()))
        result["_path"] = path.relative_to(results.parent.parent).as_posix()
        result["_commit"] = commit
        key = (date, order.get(commit, 0), n)
        found.setdefault((path.parts[-3], path.parts[-2]), []).append((key, result))
    return {k: [r for _, r in sorted(v, key=lambda x: x[0], reverse=True)] for k, v in found.items()}


def folder(table: str) -> str:
    """The bench (results folder) a table of BENCHES reads."""
    return table.split(":")[0]


def matches(row: dict, want: dict) -> bool:
    return all(row.get(k) == v for k, v in want.items())


def current_rows(results: list[dict], rows_key: str, shown: list[dict] | None) -> list[tuple[dict, dict]]:
    """(row, the result it came from): the latest file's rows, then cases only older files measured."""
    picked: list[tuple[dict, dict]] = []
    seen: set[str] = set()
    for result in results:
        for row in result.get(rows_key, []):
            case = label(row)
            if case not in seen and (shown is None or any(matches(row, w) for w in shown)):
                seen.add(case)
                picked.append((row, result))
    if shown is not None:
        picked.sort(key=lambda p: next(i for i, w in enumerate(shown) if matches(p[0], w)))
    return picked


def label(row: dict) -> str:
    """A row's case in a few words: 'mla_decode B128 ctx 4K H16'."""
    parts = [str(row[k]) for k in ("op", "kernel", "model", "run", "step", "engine", "what", "mode", "acceptance")
             if k in row]
    for key, fmt in (("n", "n={}"), ("k", "k={}"), ("w8a8", "w8a8={}"), ("batch", "B{}"), ("tokens", "T{}"),
                     ("context", "ctx {}"), ("heads", "H{}"), ("q_len", "q_len {}"),
                     ("keys_per_row", "{} keys"), ("threads", "{} thread(s)")):
        if key in row:
            value = row[key]
            if key == "context" and value % 1024 == 0:
                value = f"{value // 1024}K"
            parts.append(fmt.format(value))
    return " ".join(parts)


def cell(value, fmt: str, scale: float = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return fmt.format(value * scale if scale != 1 else value)


def target_lines(data: dict) -> list[str]:
    lines = ["| benchmark | case | figure | target | device | measured | status | commit | issue |",
             "|---|---|---|---|---|---|---|---|---|"]
    for bench, want, figure, op, threshold, issue in TARGETS:
        devices = sorted(d for b, d in data if b == folder(bench))
        rows_key = BENCHES[bench][1]
        measured = []
        for device in devices:
            value, source = None, None
            for result in data.get((folder(bench), device), []):
                row = next((r for r in result.get(rows_key, []) if matches(r, want) and figure in r), None)
                if row is not None and not (isinstance(row[figure], float) and math.isnan(row[figure])):
                    value, source = row[figure], result
                    break
            if value is not None:
                status = "met" if COMPARE[op](value, threshold) else "**not met**"
                measured.append((device, f"{value:.3g}", status, f"{source['_commit']} ({source['date']})"))
        for device, shown, status, commit in measured or [("—", "—", "not measured", "—")]:
            lines.append(f"| {bench} | {label(want)} | `{figure}` | {SIGN[op]} {threshold} | {device} | {shown} "
                         f"| {status} | {commit} | {issue} |")
    return lines


def render(data: dict) -> str:
    out = ["# Benchmark results", "",
           "Generated by `python bench/report.py` from the result files under `bench/results/` "
           "(`<bench>/<device>/<date>-<commit>.json`, logs beside them); do not edit by hand. "
           "Each table shows, per device, the latest run's figures (by date, then commit order; a case "
           "that run left out comes from the latest run that measured it: see the commit column). How each figure was reached, and what "
           "was tried and not kept, is in `bench/notes/`.", "",
           "## Targets", "", *target_lines(data)]
    for bench, (title, rows_key, shown, columns) in BENCHES.items():
        devices = sorted(d for b, d in data if b == folder(bench))
        if not devices:
            continue
        out += ["", f"## {title}", "",
                "| device | case | " + " | ".join(c[0] for c in columns) + " | commit (date) |",
                "|---|---|" + "---|" * len(columns) + "---|"]
        for device in devices:
            for row, result in current_rows(data[(folder(bench), device)], rows_key, shown):
                cells = [cell(row.get(c[1]), c[2], *c[3:]) for c in columns]
                out.append(f"| {device} | {label(row)} | " + " | ".join(cells) + f" | {result['_commit']} ({result['date']}) |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=BENCH / "RESULTS.md")
    args = parser.parse_args()
    args.out.write_text(render(load()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
