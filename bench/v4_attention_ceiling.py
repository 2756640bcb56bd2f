"""How fast Triton's `tl.dot` can run V4's decode attention at all: an ideal loop against ours and the bytes.

    python bench/v4_attention_ceiling.py [--commit SHA] [--out bench/results]

V4's 64 heads share one 512-wide key (K = V), so every key byte read serves
2 * 64 * 512 * 2 / 1024 = 128 flops. Whether a kernel can read the keys at the copy
rate is then a question of its tensor-core rate. This benchmark times the best case a
Triton kernel written with `tl.dot` can be: `_ideal_kernel`, a flash-decoding loop over
keys stored contiguously per row (no page table, no gather, no sink, no masks), its
[64, 512] queries on chip, one program per (row, split), float32 or bf16 partials. Over
a few tile shapes and split counts, the fastest is kept; it is then timed again with its key
tiles loaded through a tensor descriptor (TMA), with its loop offered to Triton's warp
specialisation (`tl.range(..., warp_specialize=True)`), and with both. Every timed variant's
splits are checked against torch's attention over their keys. Beside it, in the same run:

* ours: `v4_attention.window_entry_attention` (HCA: window + every entry) at the same
  rows and keys per row, on paged caches, with the sink and the split merge;
* cuBLAS: the two products alone (`torch.bmm`, no softmax), for the rate these shapes get
  from a library GEMM;
* the roofline: keys + queries + outputs at the copy rate, and the tensor-core rate a
  kernel would need to finish in 1.3 x that time.

Prints a table (last) and writes bench/results/v4-attention-ceiling/<gpu>/<date>-<commit>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import v4_kernels  # noqa: E402

from mla_func.kernels.triton import v4_attention  # noqa: E402
from mla_func.kernels.triton._common import dot_precision, online_softmax_fold  # noqa: E402

HEADS, HEAD_DIM = v4_kernels.HEADS, v4_kernels.HEAD_DIM
BF16 = torch.bfloat16
# (rows, keys a row): the B64 / B128 at 64K context (window 128 + 512 entries), and
# a long list where a program's fixed costs (queries, partials) no longer weigh.
CASES = ((64, 640), (128, 640), (64, 8192))
# (keys a step, warps, stages): the candidates that fit shared memory with [64, 512] queries
# on chip (larger tiles or deeper pipelines overflow the 227 KB of a multiprocessor).
TILES = ((32, 8, 3), (32, 8, 2), (64, 8, 2), (64, 8, 1), (128, 8, 1), (64, 4, 2))
SPLITS = (1, 2, 4)
TARGET = 1.3


@triton.jit
def _ideal_kernel(q_ptr, k_ptr, o_ptr, num_rows, num_keys, per_split, scale_log2,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                  WARP_SPECIALIZE: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Row t, split s: softmax(q k^T) k over keys [s * per_split, (s + 1) * per_split) of the row's
    contiguous [num_keys, D] keys, normalised, into o[t, s] (per_split a multiple of BLOCK_N). TMA:
    the key tiles through a tensor descriptor; WARP_SPECIALIZE: the loop offered to Triton's warp
    specialisation."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    hh = tl.arange(0, H)
    dd = tl.arange(0, D)
    nn = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + t.to(tl.int64) * H * D + hh[:, None] * D + dd[None, :])
    m_i = tl.full([H], float("-inf"), tl.float32)
    l_i = tl.zeros([H], tl.float32)
    acc = tl.zeros([H, D], tl.float32)
    keys_ptr = k_ptr + t.to(tl.int64) * num_keys * D
    if TMA:
        desc = tl.make_tensor_descriptor(k_ptr, shape=[num_rows * num_keys, D], strides=[D, 1],
                                         block_shape=[BLOCK_N, D])
    for n0 in tl.range(s * per_split, (s + 1) * per_split, BLOCK_N, num_stages=STAGES,
                       warp_specialize=WARP_SPECIALIZE):
        if TMA:
            keys = desc.load([t * num_keys + n0, 0])
        else:
            keys = tl.load(keys_ptr + (n0 + nn)[:, None] * D + dd[None, :])
        scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
        # The same online-softmax step as our kernels (`_common.online_softmax_fold`).
        m_i, l_i, acc = online_softmax_fold(scores, keys, m_i, l_i, acc, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (t.to(tl.int64) * tl.num_programs(1) + s) * H * D + hh[:, None] * D + dd[None, :],
             out.to(o_ptr.dtype.element_ty))


def _ideal(q, keys, out, tile, splits, warp_specialize=False, tma=False):
    block_n, num_warps, stages = tile
    num_rows, num_keys, _ = keys.shape
    _ideal_kernel[(num_rows, splits)](q, keys, out, num_rows, num_keys, num_keys // splits,
                                      HEAD_DIM ** -0.5 * 1.4426950408889634, H=HEADS, D=HEAD_DIM, BLOCK_N=block_n,
                                      STAGES=stages, WARP_SPECIALIZE=warp_specialize, TMA=tma,
                                      DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=stages)


def _check_ideal(q, keys, out, splits):
    """The loop computes attention: each split's output on the first rows against torch's softmax
    attention over that split's keys."""
    per_split = keys.shape[1] // splits
    for s in range(splits):
        k = keys[:4, s * per_split:(s + 1) * per_split].float()
        ref = torch.softmax((q[:4].float() @ k.transpose(1, 2)) * HEAD_DIM ** -0.5, dim=-1) @ k
        err = float((out[:4, s].float() - ref).abs().max())
        if err > 2e-2:
            raise AssertionError(f"ideal loop, split {s} of {splits}: off torch's attention by {err:.3g}")


def bench_case(num_rows, num_keys, ceilings):
    flops = num_rows * num_keys * HEADS * HEAD_DIM * 4
    num_bytes = v4_attention.v4_attention_bytes(num_rows, HEADS, HEAD_DIM, num_keys, 2)
    roofline_us = num_bytes / ceilings["copy"] * 1e6
    q = torch.randn(num_rows, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    # Two key sets, so that a replay does not find the previous call's keys in L2.
    key_sets = [torch.randn(num_rows, num_keys, HEAD_DIM, device="cuda", dtype=BF16) for _ in range(2)]
    row = dict(batch=num_rows, keys_per_row=num_keys, bytes=num_bytes, roofline_us=roofline_us,
               tflops_for_target=flops / (TARGET * roofline_us * 1e-6) / 1e12, candidates=[])
    best = None
    for tile in TILES:
        for splits in SPLITS:
            if num_keys % (splits * tile[0]):
                continue
            for out_dtype in (torch.float32, BF16):
                out = torch.empty(num_rows, splits, HEADS, HEAD_DIM, device="cuda", dtype=out_dtype)
                try:
                    us = common.time_graph([lambda k=k: _ideal(q, k, out, tile, splits) for k in key_sets]) * 1e3
                except triton.runtime.errors.OutOfResources:
                    continue
                _check_ideal(q, key_sets[1], out, splits)
                cand = dict(block_n=tile[0], num_warps=tile[1], stages=tile[2], splits=splits,
                            partials=str(out_dtype).removeprefix("torch."), us=us, tflops=flops / us / 1e6)
                row["candidates"].append(cand)
                if best is None or us < best["us"]:
                    best = cand
    row.update(ideal_us=best["us"], ideal_tflops=best["tflops"], ideal_ratio=best["us"] / roofline_us,
               ideal_config=f"{best['block_n']} keys, {best['num_warps']} warps, {best['stages']} stages, "
                            f"{best['splits']} splits, {best['partials']} partials")
    # The best loop again with its key tiles through TMA, offered to warp specialisation, or both.
    tile = (best["block_n"], best["num_warps"], best["stages"])
    out = torch.empty(num_rows, best["splits"], HEADS, HEAD_DIM, device="cuda", dtype=getattr(torch, best["partials"]))
    for name, warp_specialize, tma in (("tma", False, True), ("ws", True, False), ("ws_tma", True, True)):
        try:
            row[f"ideal_{name}_us"] = common.time_graph(
                [lambda k=k: _ideal(q, k, out, tile, best["splits"], warp_specialize, tma) for k in key_sets]) * 1e3
        except RuntimeError as exc:  # a variant the compiler refuses is a result of the run
            row[f"ideal_{name}_error"] = str(exc).strip().splitlines()[-1][:120]
            continue
        _check_ideal(q, key_sets[1], out, best["splits"])
    kt = [k.transpose(1, 2) for k in key_sets]
    scores = torch.empty(num_rows, HEADS, num_keys, device="cuda", dtype=BF16)
    out = torch.empty(num_rows, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    qk_us = common.time_graph([lambda k=k: torch.bmm(q, k, out=scores) for k in kt]) * 1e3
    pv_us = common.time_graph([lambda k=k: torch.bmm(scores, k, out=out) for k in key_sets]) * 1e3
    row.update(cublas_us=qk_us + pv_us, cublas_tflops=flops / (qk_us + pv_us) / 1e6)
    if num_keys <= 1024:
        # Ours on the same keys a row: HCA, window 128 + every entry of a context of (keys - 128) * 128.
        ours = v4_kernels.bench_attention(num_rows, (num_keys - v4_kernels.WINDOW) * v4_kernels.HCA_RATE, "hca",
                                          ceilings, eager=False)
        row.update(ours_us=ours["us"], ours_tflops=flops / ours["us"] / 1e6, ours_ratio=ours["us"] / roofline_us)
    return row


def main(argv=None) -> None:
    args = common.kernel_bench_parser(__doc__).parse_args(argv)
    # Tensor descriptors built inside a kernel take their scratch from this allocator.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    result, ceilings = common.kernel_bench_run(
        "bench/v4_attention_ceiling.py", args.commit, matmul=True,
        timing=common.GRAPH_REPLAY_TIMING, target=f"t/t_copy <= {TARGET} (issue's V4 attention rows at B >= 64)")
    for num_rows, num_keys in CASES:
        result["rows"].append(bench_case(num_rows, num_keys, ceilings))
        print({k: v for k, v in result["rows"][-1].items() if k != "candidates"}, flush=True)
        torch.cuda.empty_cache()
    path = common.write_json(result, args.out, "v4-attention-ceiling")
    print(f"\n{result['gpu']}  commit {result['commit'][:12]}  copy {result['copy_bandwidth_gb_s']:.0f} GB/s  "
          f"bf16 mm {result['bf16_matmul_tflop_s']:.0f} TFLOP/s  -> {path}")
    common.print_table(result["rows"], [
        ("batch", "B"), ("keys_per_row", "keys/row"), ("roofline_us", "roofline us"),
        ("tflops_for_target", f"TFLOP/s for {TARGET}x"), ("ideal_us", "ideal us"), ("ideal_tflops", "ideal TFLOP/s"),
        ("ideal_ratio", "ideal t/t_copy"), ("ideal_tma_us", "TMA us"), ("ideal_ws_us", "warp-spec. us"),
        ("ideal_ws_tma_us", "both us"), ("ours_us", "ours us"), ("ours_ratio", "ours t/t_copy"),
        ("cublas_us", "cuBLAS 2 bmm us"), ("ideal_config", "ideal config")])


if __name__ == "__main__":
    main()
