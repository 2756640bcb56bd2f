"""Kernel benchmark: Triton ops against the device's own copy bandwidth and bf16 matmul rate.

    python bench/kernels.py [--commit SHA] [--out bench/results] [--skip-reference]
    python bench/kernels.py --sweep      # time tile-size candidates instead (no result file)
    python bench/kernels.py --fp8        # only the block-scaled FP8 rows (with --sweep: their tiles)
    python bench/kernels.py --fp8-cache  # only the decode kernel over a bf16 and an FP8 latent cache, B64 x 32K
    python bench/kernels.py --fp4        # only V4's FP4 experts read packed (with --sweep: their tiles)
    python bench/kernels.py --wgmma      # only the 128-head decode: the warpgroup-MMA kernel beside its twin

Prints a table and writes bench/results/kernels/<gpu>/<date>-<commit>.json. Both ceilings
(device-to-device copy bandwidth, counting bytes read and written, and a bf16
8192^3 torch.mm) are measured in the same run. Decode and MoE are timed as CUDA
graph replays (how the model runs them), with consecutive calls reading other
pages / experts so that no call finds its data in L2; eager timings (launch
overhead included, L2 flushed) are recorded beside them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from mla_func.kernels.latent_cache import scale_groups  # noqa: E402
from mla_func.kernels.reference import attention as ref_attention  # noqa: E402
from mla_func.kernels.reference import moe as ref_moe  # noqa: E402
from mla_func.kernels.reference.cache import quantized_cache  # noqa: E402
from mla_func.kernels.fp4_weight import SCALE_DTYPE, BlockFP4Weight  # noqa: E402
from mla_func.kernels.gluon import fp4_experts as wgmma_fp4  # noqa: E402
from mla_func.kernels.triton import decode, fp4_experts, fp4_pairs, fp8_linear, fp8_moe, moe, prefill  # noqa: E402
from mla_func.kernels.triton.fp8_quant import quantize_activations  # noqa: E402

KV_LORA_RANK, ROPE_DIM = 512, 64
DIM = KV_LORA_RANK + ROPE_DIM
BF16 = torch.bfloat16
L2_DEFEAT_BYTES = 256 << 20


# --- MLA decode ---------------------------------------------------------------------------

# Bytes a token of the latent cache: bf16 (C + R values of 2 bytes), or FP8 (C values of 1 byte, a float32
# scale per 128 of them, R bf16 RoPE values): 1152 and 656 at C = 512, R = 64.
TOKEN_BYTES = {"auto": DIM * 2, "fp8": KV_LORA_RANK + 4 * scale_groups(KV_LORA_RANK) + ROPE_DIM * 2}


def _fp8_cache(dense):
    """The FP8 latent cache of a bf16 one [nb, bs, C + R], every row quantized by the cache write."""
    return quantized_cache(dense, KV_LORA_RANK)


def _decode_setup(num_seqs, context, num_heads, block_size, copies, cache_dtype="auto", q_len=1):
    width = context // block_size
    num_blocks = copies * num_seqs * width + 1
    kv_cache = torch.randn(num_blocks, block_size, DIM, device="cuda", dtype=BF16)
    if cache_dtype == "fp8":
        kv_cache = _fp8_cache(kv_cache)
    pages = (torch.randperm(num_blocks - 1, device="cuda") + 1).to(torch.int32)
    tables = list(pages.view(copies, num_seqs, width))
    q = torch.randn(num_seqs * q_len, num_heads, DIM, device="cuda", dtype=BF16)
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    return kv_cache, tables, q, lens


def _decode_kernel(config):
    """The kernel a decode config takes, as the result rows name it."""
    if config.wgmma or config.narrow:
        return "wgmma" if config.wgmma else "narrow"
    return "chunks" if config.chunks == 4 else "rows"


def bench_decode(num_seqs, context, num_heads, ceilings, block_size=64, config=None, num_splits=None,
                 reference=False, eager=True, cache_dtype="auto", check_seqs=0, q_len=1):
    """One decode row (`q_len` queries a sequence: verify rows); `check_seqs` > 0 compares that many
    sequences' outputs with the reference over the same cache (max_err_vs_ref, without the reference's
    timing, which `reference` adds for every sequence). Flops count every query over the whole context."""
    kv_bytes = num_seqs * context * TOKEN_BYTES[cache_dtype]
    copies = min(16, max(1, math.ceil(L2_DEFEAT_BYTES / kv_bytes)))
    kv_cache, tables, q, lens = _decode_setup(num_seqs, context, num_heads, block_size, copies, cache_dtype, q_len)
    scale = DIM ** -0.5
    config = config or decode.launch_config(num_heads, q_len, KV_LORA_RANK, ROPE_DIM, q.device,
                                             cache_dtype == "fp8", BF16)
    splits = num_splits or decode.mla_decode_num_splits(num_seqs, num_heads, tables[0].shape[1], block_size,
                                                        q.device, config, q_len=q_len)
    rows = num_seqs * q_len
    workspace = (torch.empty(rows, num_heads, splits, KV_LORA_RANK, device="cuda"),
                 torch.empty(rows, num_heads, splits, device="cuda"))

    def call(table):
        return decode.mla_decode(q, kv_cache, table, lens, softmax_scale=scale, kv_lora_rank=KV_LORA_RANK,
                                 workspace=workspace, num_splits=splits, config=config, q_len=q_len)

    ms = common.time_graph([lambda t=t: call(t) for t in tables])
    num_bytes = kv_bytes + q.numel() * 2 + rows * num_heads * KV_LORA_RANK * 2
    flops = q_len * decode.decode_flops(num_heads, num_seqs * context, KV_LORA_RANK, ROPE_DIM)
    row = dict(op="mla_decode", batch=num_seqs, context=context, heads=num_heads, block_size=block_size,
               cache=cache_dtype, splits=splits, q_len=q_len, kernel=_decode_kernel(config), ms=ms,
               gb_s=num_bytes / ms / 1e6, tflop_s=flops / ms / 1e9,
               pct_copy=100 * num_bytes / (ms * 1e-3) / ceilings["copy"],
               pct_matmul=100 * flops / (ms * 1e-3) / ceilings["matmul"], bytes=num_bytes, flops=flops)
    if eager:
        row["eager_ms"] = common.time_eager(lambda: call(tables[0]))
    if check_seqs:
        out, _ = call(tables[0])
        ref_out, _ = ref_attention.mla_decode(q[:check_seqs * q_len], kv_cache, tables[0][:check_seqs],
                                              lens[:check_seqs], softmax_scale=scale, kv_lora_rank=KV_LORA_RANK,
                                              q_len=q_len)
        row["max_err_vs_ref"] = (out[:check_seqs * q_len].float() - ref_out.float()).abs().max().item()
    if reference:
        out, lse = call(tables[0])
        ref_out, ref_lse = ref_attention.mla_decode(q, kv_cache, tables[0], lens, softmax_scale=scale,
                                                    kv_lora_rank=KV_LORA_RANK, q_len=q_len)
        row["max_err_vs_ref"] = (out.float() - ref_out.float()).abs().max().item()
        row["ref_ms"] = common.time_eager(lambda: ref_attention.mla_decode(
            q, kv_cache, tables[0], lens, softmax_scale=scale, kv_lora_rank=KV_LORA_RANK, q_len=q_len), rep_ms=50)
    return row


def fp8_cache_rows(ceilings, num_seqs=64, context=32768):
    """The decode kernel over a bf16 and over an FP8 latent cache (`kv_cache_dtype="fp8"`) at B64 x 32K,
    16 and 128 heads, in one run: each pair's time ratio (bf16 / FP8) is printed and recorded on the FP8 row."""
    rows = []
    for num_heads in (16, 128):
        bf16 = bench_decode(num_seqs, context, num_heads, ceilings, eager=False, check_seqs=2)
        fp8 = bench_decode(num_seqs, context, num_heads, ceilings, eager=False, cache_dtype="fp8", check_seqs=2)
        fp8["bf16_over_fp8"] = bf16["ms"] / fp8["ms"]
        rows += [bf16, fp8]
        print(f"mla_decode B{num_seqs} ctx{context} H{num_heads}: bf16 cache {bf16['ms']:.3f} ms, FP8 cache "
              f"{fp8['ms']:.3f} ms, bf16 / FP8 = {fp8['bf16_over_fp8']:.2f}x", flush=True)
    return rows


# --- fused MoE ----------------------------------------------------------------------------

def wgmma_rows(ceilings):
    """128 heads: the warpgroup-MMA decode and its twin in one run (one query a row, B64/B128 x 4K-32K; verify
    rows of 2-4 queries at B64 x 4K), each row checked against the reference on two sequences."""
    rows = []
    cases = [(b, ctx, 1) for b in (64, 128) for ctx in (4096, 16384, 32768)] + [(64, 4096, n) for n in (2, 3, 4)]
    for num_seqs, context, q_len in cases:
        pair = []
        twin = decode.launch_config(128, q_len, KV_LORA_RANK, ROPE_DIM, torch.device("cuda"), False, BF16, wgmma=False)
        for config in (None, twin):
            pair.append(bench_decode(num_seqs, context, 128, ceilings, config=config, eager=False, check_seqs=2,
                                     q_len=q_len))
        pair[0]["speedup_vs_twin"] = pair[1]["ms"] / pair[0]["ms"]
        rows += pair
        print(f"B{num_seqs} ctx{context} H128 q_len {q_len}: {pair[0]['kernel']} {pair[0]['tflop_s']:.0f} TFLOP/s, "
              f"{pair[1]['kernel']} {pair[1]['tflop_s']:.0f}: {pair[0]['speedup_vs_twin']:.2f}x", flush=True)
    return rows


def bench_moe(num_tokens, ceilings, num_experts=64, top_k=6, hidden=2048, inter=1408, config=None,
              reference=False, eager=True, routing_sets=8):
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=BF16)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=BF16) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=BF16) * inter ** -0.5
    routes = []
    for _ in range(routing_sets):
        weights, ids = torch.rand(num_tokens, num_experts, device="cuda").topk(top_k, dim=1)
        routes.append(((weights / weights.sum(1, keepdim=True)).float(), ids.to(torch.int32)))

    def call(route):
        return moe.fused_moe(x, w13, w2, route[0], route[1], config=config)

    ms = common.time_graph([lambda r=r: call(r) for r in routes])
    expert_bytes = (2 * inter * hidden + hidden * inter) * 2
    distinct = sum(r[1].unique().numel() for r in routes) / routing_sets
    num_bytes = distinct * expert_bytes + 2 * x.numel() * 2
    flops = num_tokens * top_k * 2 * (2 * inter * hidden + hidden * inter)
    row = dict(op="fused_moe", tokens=num_tokens, experts=num_experts, top_k=top_k, hidden=hidden, inter=inter,
               distinct_experts=distinct, ms=ms, gb_s=num_bytes / ms / 1e6, tflop_s=flops / ms / 1e9,
               pct_copy=100 * num_bytes / (ms * 1e-3) / ceilings["copy"],
               pct_matmul=100 * flops / (ms * 1e-3) / ceilings["matmul"], bytes=num_bytes, flops=flops,
               copy_time_ratio=ms * 1e-3 / (num_bytes / ceilings["copy"]))
    if eager:
        row["eager_ms"] = common.time_eager(lambda: call(routes[0]))
    if reference:
        out = call(routes[0])
        expected = ref_moe.fused_moe(x, w13, w2, *routes[0])
        row["max_err_vs_ref"] = (out.float() - expected.float()).abs().max().item()
        row["ref_ms"] = common.time_eager(lambda: ref_moe.fused_moe(x, w13, w2, *routes[0]), rep_ms=50)
    return row


# --- prefill ------------------------------------------------------------------------------

def bench_prefill(num_tokens, ceilings, num_heads=16, nope_dim=128, v_dim=128, block_size=64, config=None,
                  reference=False):
    width = num_tokens // block_size
    kv_cache = torch.randn(width + 1, block_size, DIM, device="cuda", dtype=BF16)
    block_table = (torch.randperm(width, device="cuda") + 1).to(torch.int32).view(1, width)
    q_nope = torch.randn(num_tokens, num_heads, nope_dim, device="cuda", dtype=BF16)
    q_pe = torch.randn(num_tokens, num_heads, ROPE_DIM, device="cuda", dtype=BF16)
    w_uk = torch.randn(num_heads, nope_dim, KV_LORA_RANK, device="cuda", dtype=BF16) * KV_LORA_RANK ** -0.5
    w_uv = torch.randn(num_heads, v_dim, KV_LORA_RANK, device="cuda", dtype=BF16) * KV_LORA_RANK ** -0.5
    cu = torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda")
    lens = torch.tensor([num_tokens], dtype=torch.int32, device="cuda")
    positions = torch.arange(num_tokens, device="cuda")
    scale = (nope_dim + ROPE_DIM) ** -0.5
    args = (q_nope, q_pe, kv_cache, block_table, cu, lens, positions, w_uk, w_uv)

    whole_ms = common.time_eager(lambda: prefill.prefill_attention(*args, softmax_scale=scale, config=config))
    decompress_ms = common.time_eager(lambda: prefill.decompress_context(kv_cache, block_table, w_uk, w_uv))
    k_nope, k_pe, value = prefill.decompress_context(kv_cache, block_table, w_uk, w_uv)
    out = torch.empty(num_tokens, num_heads, v_dim, device="cuda", dtype=BF16)
    lse = torch.empty(num_tokens, num_heads, device="cuda")
    kernel_ms = common.time_eager(lambda: prefill.flash_prefill(
        q_nope, q_pe, k_nope, k_pe, value, cu, lens, positions, out, lse, softmax_scale=scale, config=config))
    pairs = num_tokens * (num_tokens + 1) // 2
    flops = prefill.prefill_flops(pairs, num_heads, nope_dim, ROPE_DIM, v_dim, num_tokens, KV_LORA_RANK)
    row = dict(op="prefill_attention", tokens=num_tokens, heads=num_heads, nope_dim=nope_dim, rope_dim=ROPE_DIM,
               v_dim=v_dim, kv_lora_rank=KV_LORA_RANK, ms=whole_ms, kernel_ms=kernel_ms,
               decompress_ms=decompress_ms, flops=flops["total"], attention_flops=flops["attention"],
               decompress_flops=flops["decompress"],
               flops_counted="decompressed MLA: 2*(Dn+R+Dv) per visible (query, key) pair per head "
                             "+ 2*S*C*H*(Dn+Dv) for decompressing the context",
               tflop_s=flops["total"] / whole_ms / 1e9,
               kernel_tflop_s=flops["attention"] / kernel_ms / 1e9,
               pct_matmul=100 * flops["total"] / (whole_ms * 1e-3) / ceilings["matmul"],
               kernel_pct_matmul=100 * flops["attention"] / (kernel_ms * 1e-3) / ceilings["matmul"])
    if reference:
        got, got_lse = prefill.prefill_attention(*args, softmax_scale=scale, config=config)
        expected, expected_lse = ref_attention.prefill_attention(*args, softmax_scale=scale)
        row["max_err_vs_ref"] = (got.float() - expected.float()).abs().max().item()
        row["max_lse_err_vs_ref"] = (got_lse - expected_lse).abs().max().item()
        row["ref_ms"] = common.time_eager(lambda: ref_attention.prefill_attention(*args, softmax_scale=scale),
                                          warmup_ms=1, rep_ms=1)
    return row


# --- block-scaled FP8 linear and MoE ---------------------------------------------------------

FP8_BLOCK = (128, 128)


def _fp8_weights(shape, copies):
    """`copies` random FP8 weights [..., N, K] with their [..., N/128, K/128] scales (about 1/sqrt(K) each)."""
    *lead, n, k = shape
    scale_shape = (*lead, math.ceil(n / FP8_BLOCK[0]), math.ceil(k / FP8_BLOCK[1]))
    return [(torch.randn(shape, device="cuda", dtype=BF16).to(torch.float8_e4m3fn),
             torch.rand(scale_shape, device="cuda") * 2 * k ** -0.5 / 448) for _ in range(copies)]


def bench_fp8_gemm(num_tokens, n, k, ceilings, w8a8=True, tiles=None):
    """The block GEMM at prefill sizes: whole op (activation quantization included) and GEMM alone."""
    x = torch.randn(num_tokens, k, device="cuda", dtype=BF16)
    (values, scale_inv), = _fp8_weights((n, k), 1)
    a, a_scales = quantize_activations(x, FP8_BLOCK[1]) if w8a8 else (x, scale_inv)
    gemm_ms = common.time_eager(lambda: fp8_linear.block_gemm(a, a_scales, values, scale_inv, FP8_BLOCK, w8a8, BF16,
                                                              BF16, tiles))
    ms = gemm_ms if tiles else common.time_eager(lambda: fp8_linear.fp8_linear(x, values, scale_inv, w8a8=w8a8))
    flops = 2 * num_tokens * n * k
    return dict(op="fp8_gemm", tokens=num_tokens, n=n, k=k, w8a8=w8a8, ms=ms, gemm_ms=gemm_ms,
                tflop_s=flops / ms / 1e9, gemm_tflop_s=flops / gemm_ms / 1e9,
                pct_matmul=100 * flops / (ms * 1e-3) / ceilings["matmul"], flops=flops)


def bench_fp8_decode(num_tokens, n, k, ceilings, w8a8=False, tiles=None):
    """The decode-size product (one row without w8a8: the one-row kernel; else the weight stream; `tiles` forces
    the stream): graph replays over weight copies that do not fit L2 together."""
    copies = min(16, max(2, math.ceil(L2_DEFEAT_BYTES / (n * k))))
    weights = _fp8_weights((n, k), copies)
    x = torch.randn(num_tokens, k, device="cuda", dtype=BF16)
    ms = common.time_graph([lambda w=w: fp8_linear.fp8_linear(x, *w, w8a8=w8a8, stream=tiles) for w in weights])
    num_bytes = n * k + weights[0][1].numel() * 4 + x.numel() * 2 + num_tokens * n * 2
    return dict(op="fp8_linear", tokens=num_tokens, n=n, k=k, w8a8=w8a8, ms=ms, gb_s=num_bytes / ms / 1e6,
                pct_copy=100 * num_bytes / (ms * 1e-3) / ceilings["copy"], bytes=num_bytes,
                copy_time_ratio=ms * 1e-3 / (num_bytes / ceilings["copy"]))


def bench_fp8_moe(num_tokens, ceilings, num_experts=32, top_k=8, hidden=7168, inter=2048, w8a8=False, config=None,
                  routing_sets=8):
    """The FP8 MoE over DeepSeek-V3's expert shapes; bytes are the distinct chosen experts' values and scales."""
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=BF16)
    (w13, s13), = _fp8_weights((num_experts, 2 * inter, hidden), 1)
    (w2, s2), = _fp8_weights((num_experts, hidden, inter), 1)
    routes = []
    for _ in range(routing_sets):
        weights, ids = torch.rand(num_tokens, num_experts, device="cuda").topk(top_k, dim=1)
        routes.append(((weights / weights.sum(1, keepdim=True)).float(), ids.to(torch.int32)))

    def call(route):
        return fp8_moe.fp8_fused_moe(x, w13, s13, w2, s2, *route, w8a8=w8a8, config=config)

    ms = common.time_graph([lambda r=r: call(r) for r in routes])
    expert_bytes = 3 * inter * hidden + (s13[0].numel() + s2[0].numel()) * 4
    distinct = sum(r[1].unique().numel() for r in routes) / routing_sets
    num_bytes = distinct * expert_bytes + 2 * x.numel() * 2
    flops = num_tokens * top_k * 2 * 3 * inter * hidden
    return dict(op="fp8_moe", tokens=num_tokens, experts=num_experts, top_k=top_k, hidden=hidden, inter=inter,
                w8a8=w8a8, distinct_experts=distinct, ms=ms, gb_s=num_bytes / ms / 1e6, tflop_s=flops / ms / 1e9,
                pct_copy=100 * num_bytes / (ms * 1e-3) / ceilings["copy"], bytes=num_bytes, flops=flops,
                copy_time_ratio=ms * 1e-3 / (num_bytes / ceilings["copy"]))


def fp8_rows(ceilings):
    rows = []
    for num_tokens in (1024, 4096):
        for n, k in ((7168, 7168), (18432, 7168)):
            rows.append(bench_fp8_gemm(num_tokens, n, k, ceilings))
    # The same products with the activations as they are (steps without w8a8): each FP8 tile widened.
    for n, k in ((7168, 7168), (18432, 7168)):
        rows.append(bench_fp8_gemm(1024, n, k, ceilings, w8a8=False))
    for num_tokens in (1, 4, 16):
        for n, k in ((7168, 7168), (18432, 7168), (7168, 18432)):
            for w8a8 in (False, True):
                rows.append(bench_fp8_decode(num_tokens, n, k, ceilings, w8a8=w8a8))
    for num_tokens in (1, 16, 1024):
        for w8a8 in (False, True):
            rows.append(bench_fp8_moe(num_tokens, ceilings, w8a8=w8a8))
    return rows


def sweep_fp8(ceilings):
    rows = []
    for t in [fp8_linear.GemmTiles(128, 128, 128, 8, 8, 4), fp8_linear.GemmTiles(128, 128, 64, 8, 8, 4)]:
        try:
            r = bench_fp8_gemm(4096, 18432, 7168, ceilings, tiles=t)
        except Exception as exc:  # a config that does not compile is a sweep result, not a failure
            r = dict(op="fp8_gemm", error=repr(exc)[:120])
        common.sweep_row(rows, r, case="gemm T4096 18432x7168", config=str(t))
    for num_tokens in (1, 16):
        for t in [fp8_linear.StreamTiles(n, 128, s, w, 4) for n in (64, 128) for s in (1, 2, 4) for w in (4, 8)]:
            try:
                r = bench_fp8_decode(num_tokens, 7168, 7168, ceilings, tiles=t)
            except Exception as exc:
                r = dict(op="fp8_linear", error=repr(exc)[:120])
            common.sweep_row(rows, r, case=f"stream T{num_tokens} 7168x7168", config=str(t))
    for num_tokens in (1, 16):
        for c in [fp8_moe.Fp8MoeConfig(16, n, 128, w, st) for n in (32, 64) for w in (4, 8) for st in (3, 4)]:
            r = bench_fp8_moe(num_tokens, ceilings, config=c)
            common.sweep_row(rows, r, case=f"moe T{num_tokens}", config=str(c))
    print("\n== FP8 sweep ==")
    common.print_table(rows, [("case", "case"), ("config", "config"), ("ms", "ms"), ("gemm_tflop_s", "TFLOP/s"),
                              ("pct_copy", "%copy"), ("error", "error")])
    return rows


# --- DeepSeek-V4's FP4 experts, read packed ------------------------------------------------------

def _fp4_weight(shape):
    """A random FP4 weight [E, N, K] as V4 ships its experts: packed bytes, one e8m0 scale per 32 values."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), device="cuda", dtype=torch.uint8)
    scale = torch.randint(119, 122, (*lead, n, k // 32), device="cuda", dtype=torch.uint8).view(SCALE_DTYPE)
    return BlockFP4Weight(packed, scale, (1, 32))


def bench_fp4_experts(num_tokens, ceilings, num_experts=256, top_k=6, hidden=4096, inter=2048, config=None,
                      routing_sets=8, scales_on_acc=False):
    """`fp4_experts.fp4_clamped_experts` over V4-Flash's routed experts (256 of D 4096, I 2048, top 6); bytes
    are what it reads: the distinct chosen experts' packed values and scales, and the activations (x read,
    the output written), as `bench_fp8_moe` counts them."""
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=BF16)
    w13, w2 = _fp4_weight((num_experts, 2 * inter, hidden)), _fp4_weight((num_experts, hidden, inter))
    if config is None:
        config = fp4_experts.fp4_moe_config(num_tokens * top_k, num_experts, x.device,
                                            warpgroup=wgmma_fp4.applies(x, w13, w2))
        if isinstance(config, fp4_experts.Fp4MoeConfig):
            config = dataclasses.replace(config, scales_on_acc=scales_on_acc)
    routes = []
    for _ in range(routing_sets):
        weights, ids = torch.rand(num_tokens, num_experts, device="cuda").topk(top_k, dim=1)
        routes.append(((weights / weights.sum(1, keepdim=True)).float(), ids.to(torch.int32)))

    def call(route):
        return fp4_experts.fp4_clamped_experts(x, w13, w2, *route, limit=10.0, config=config)

    ms = common.time_graph([lambda r=r: call(r) for r in routes])
    expert_bytes = (w13[0].nbytes + w2[0].nbytes)
    distinct = sum(r[1].unique().numel() for r in routes) / routing_sets
    num_bytes = distinct * expert_bytes + 2 * x.numel() * 2
    flops = num_tokens * top_k * 2 * 3 * inter * hidden
    tiled = isinstance(config, fp4_experts.Fp4MoeConfig)
    run = "per pair" if not tiled else "warpgroup tiles" if config.wgmma else "widened tiles" if config.widened else (
        "scales on products" if config.scales_on_acc else "scales on tiles")
    return dict(op="fp4_experts", run=run, tokens=num_tokens, experts=num_experts, top_k=top_k, hidden=hidden,
                inter=inter, scales_on_acc=tiled and config.scales_on_acc, distinct_experts=distinct, ms=ms, us=ms * 1e3,
                gb_s=num_bytes / ms / 1e6, tflop_s=flops / ms / 1e9,
                pct_copy=100 * num_bytes / (ms * 1e-3) / ceilings["copy"], bytes=num_bytes, flops=flops,
                copy_time_ratio=ms * 1e-3 / (num_bytes / ceilings["copy"]))


# An expert-parallel rank's share of V4-Flash's experts on eight GPUs (EP 8: 32 of 256), at 64 and 128 of its own
# sequences a step: each of its experts takes 12 or 24 rows, the load `bench/notes/parallel.md`'s V4-Flash layout needs.
EP8_EXPERTS = 32
EP8_TOKENS = (64, 128)


def fp4_rows(ceilings):
    """The default path (per pair, the widened tiles on the warpgroup MMA or `dot_scaled`'s:
    `fp4_experts.fp4_moe_config`) at 1 to 256 tokens, and `dot_scaled`'s decode tiles beside it wherever it is
    another path (at 1, 4 and 16 tokens also with the scales applied to the products), the warpgroup tiles'
    Triton twin beside them; then the default path over an expert-parallel rank's 32 experts at 64 and 128
    tokens (`EP8_EXPERTS`)."""
    # dot_scaled's decode tiles: what the config takes at 12 rows an expert (past the widened tiles' reach).
    tiled = fp4_experts.fp4_moe_config(fp4_pairs.FP4_PAIR_MAX_PAIRS + 1, 16, torch.device("cuda"))
    rows = []
    for num_tokens in (1, 4, 16, 64, 256):
        default = bench_fp4_experts(num_tokens, ceilings)
        rows.append(default)
        if default["run"] != "scales on tiles":
            rows.append(bench_fp4_experts(num_tokens, ceilings, config=tiled))
        if default["run"] == "warpgroup tiles":
            twin = dataclasses.replace(fp4_experts.fp4_moe_config(num_tokens * 6, 256, torch.device("cuda"),
                                                                  warpgroup=True), wgmma=False)
            rows.append(bench_fp4_experts(num_tokens, ceilings, config=twin))
        if num_tokens <= 16:
            rows.append(bench_fp4_experts(num_tokens, ceilings, config=dataclasses.replace(tiled, scales_on_acc=True)))
    for num_tokens in EP8_TOKENS:
        row = bench_fp4_experts(num_tokens, ceilings, num_experts=EP8_EXPERTS)
        rows.append({**row, "run": f"{row['run']}, {EP8_EXPERTS} of 256 experts (EP 8)"})
    return rows


def sweep_fp4(ceilings):
    rows = []
    for num_tokens in (1, 16):
        for c in [fp4_experts.Fp4MoeConfig(m, n, k, w, st, on_acc) for m in (16, 32)
                  for (n, k) in ((32, 128), (64, 128), (64, 256)) for w in (4, 8) for st in (3, 4)
                  for on_acc in (False, True)]:
            try:
                r = bench_fp4_experts(num_tokens, ceilings, config=c)
            except Exception as exc:  # a config that does not compile is a sweep result, not a failure
                r = dict(op="fp4_experts", error=repr(exc)[:120])
            common.sweep_row(rows, r, case=f"fp4 experts T{num_tokens}", config=str(c))
    print("\n== FP4 sweep ==")
    common.print_table(rows, [("case", "case"), ("config", "config"), ("ms", "ms"), ("pct_copy", "%copy"),
                              ("error", "error")])
    return rows


# --- tile sweeps --------------------------------------------------------------------------

def sweep(ceilings):
    rows = []
    for cfg in [decode.DecodeConfig(16, n, w, s) for n in (16, 32, 64) for w in (4, 8) for s in (1, 2)]:
        try:
            r = bench_decode(128, 4096, 16, ceilings, config=cfg, eager=False)
        except Exception as exc:  # a config that does not compile is a sweep result, not a failure
            r = dict(op="mla_decode", error=repr(exc)[:120])
        rows.append(dict(r, config=str(cfg), case="decode B128 ctx4K H16"))
    for splits in (1, 2, 3, 4, 6, 8):
        r = bench_decode(128, 4096, 16, ceilings, num_splits=splits, eager=False)
        rows.append(dict(r, config="default", case="decode B128 ctx4K H16"))
    for splits in (1, 2, 4, 8, 16, 32):
        r = bench_decode(1, 16384, 16, ceilings, num_splits=splits, eager=False)
        rows.append(dict(r, config="default", case="decode B1 ctx16K H16"))
    for cfg in [decode.DecodeConfig(h, n, w, 2) for h in (16, 32, 64) for n in (16, 32) for w in (4, 8)]:
        try:
            r = bench_decode(64, 4096, 128, ceilings, config=cfg, eager=False)
        except Exception as exc:
            r = dict(op="mla_decode", error=repr(exc)[:120])
        rows.append(dict(r, config=str(cfg), case="decode B64 ctx4K H128"))
    for cfg in [prefill.PrefillConfig(m, n, w, s) for (m, n, w) in ((128, 64, 8), (128, 128, 8), (64, 64, 4),
                                                                     (128, 64, 4), (64, 128, 4)) for s in (2, 3)]:
        try:
            r = bench_prefill(8192, ceilings, config=cfg)
        except Exception as exc:
            r = dict(op="prefill_attention", error=repr(exc)[:120])
        rows.append(dict(r, config=str(cfg), case="prefill 8K H16"))
    for cfg in [moe.MoeConfig(16, n, k, w, s) for (n, k) in ((16, 256), (32, 256), (32, 128), (64, 128),
                                                              (64, 64)) for w in (4, 8) for s in (3, 5)]:
        try:
            r = bench_moe(1, ceilings, config=cfg, eager=False)
        except Exception as exc:
            r = dict(op="fused_moe", error=repr(exc)[:120])
        rows.append(dict(r, config=str(cfg), case="moe T1"))
    for cfg in [moe.MoeConfig(m, n, k, w, 3) for (m, n, k) in ((64, 128, 64), (128, 128, 64), (64, 64, 64))
                for w in (4, 8)]:
        try:
            r = bench_moe(2048, ceilings, config=cfg, eager=False)
        except Exception as exc:
            r = dict(op="fused_moe", error=repr(exc)[:120])
        rows.append(dict(r, config=str(cfg), case="moe T2048"))
    print("\n== sweep ==")
    common.print_table(rows, [("case", "case"), ("config", "config"), ("splits", "splits"), ("ms", "ms"),
                              ("gb_s", "GB/s"), ("tflop_s", "TFLOP/s"), ("kernel_tflop_s", "kern TFLOP/s"),
                              ("error", "error")])
    return rows


def main() -> None:
    parser = common.kernel_bench_parser(__doc__)
    parser.add_argument("--skip-reference", action="store_true", help="no torch reference timings")
    parser.add_argument("--fp8", action="store_true", help="only the block-scaled FP8 rows (or, with --sweep, tiles)")
    parser.add_argument("--fp4", action="store_true",
                        help="only V4's FP4 experts read packed (or, with --sweep, their tiles)")
    parser.add_argument("--wgmma", action="store_true",
                        help="only the 128-head decode: the warpgroup-MMA kernel beside its tl.dot twin")
    parser.add_argument("--fp8-cache", action="store_true",
                        help="only the decode kernel over a bf16 and an FP8 latent cache (B64 x 32K), and their ratio")
    args = parser.parse_args()
    result, ceilings = common.kernel_bench_run(
        "bench/kernels.py", args.commit, matmul=True,
        timing="decode and MoE: CUDA-graph replay, consecutive calls on other pages/experts; "
               "eager_ms and prefill: triton.testing.do_bench median, L2 flushed")
    if args.sweep and args.fp8:
        sweep_fp8(ceilings)
        return
    if args.sweep and args.fp4:
        sweep_fp4(ceilings)
        return
    if args.sweep:
        sweep(ceilings)
        return
    if args.fp8:
        result["rows"] += fp8_rows(ceilings)
        _report(result, args.out)
        return
    if args.wgmma:
        result["rows"] += wgmma_rows(ceilings)
        _report(result, args.out)
        return
    if args.fp8_cache:
        result["rows"] += fp8_cache_rows(ceilings)
        _report(result, args.out)
        return
    if args.fp4:
        result["rows"] += fp4_rows(ceilings)
        _report(result, args.out)
        return

    ref = not args.skip_reference
    for num_heads in (16, 128):
        for num_seqs in (1, 16, 64, 128):
            for context in (1024, 4096, 16384):
                check = ref and num_seqs == 16 and context <= 4096
                result["rows"].append(bench_decode(num_seqs, context, num_heads, ceilings, reference=check))
                print(".", end="", flush=True)
    for num_tokens in (1, 16, 2048):
        result["rows"].append(bench_moe(num_tokens, ceilings, reference=ref and num_tokens <= 16))
    result["rows"].append(bench_prefill(8192, ceilings, reference=ref))
    result["rows"] += fp8_rows(ceilings)
    result["rows"] += fp4_rows(ceilings)
    print()
    _report(result, args.out)


def _report(result, out):
    path = common.write_json(result, out, "kernels")
    rows = []
    for c in result["rows"]:
        shape = {"mla_decode": lambda c: f"B{c['batch']} ctx{c['context']} H{c['heads']} s{c['splits']}"
                               + (f" q{c['q_len']}" if c.get("q_len", 1) > 1 else "")
                               + (f" {c['kernel']}" if "kernel" in c else "")
                               + (" fp8 cache" if c.get("cache") == "fp8" else ""),
                 "fused_moe": lambda c: f"T{c['tokens']} E{c['experts']} k{c['top_k']}",
                 "prefill_attention": lambda c: f"T{c['tokens']} H{c['heads']}",
                 "fp8_gemm": lambda c: f"T{c['tokens']} {c['n']}x{c['k']}" + " w8a8" * c["w8a8"],
                 "fp8_linear": lambda c: f"T{c['tokens']} {c['n']}x{c['k']}" + " w8a8" * c["w8a8"],
                 "fp8_moe": lambda c: f"T{c['tokens']} E{c['experts']} k{c['top_k']}" + " w8a8" * c["w8a8"],
                 "fp4_experts": lambda c: f"T{c['tokens']} E{c['experts']} k{c['top_k']}"
                                          + " scales on products" * c.get("scales_on_acc", False)}[c["op"]](c)
        rows.append(dict(c, shape=shape))
    print(f"\n{result['gpu']}  commit {result['commit'][:12]}  copy {result['copy_bandwidth_gb_s']:.0f} GB/s  "
          f"mm {result['bf16_matmul_tflop_s']:.0f} TFLOP/s  -> {path}")
    common.print_table(rows, [("op", "op"), ("shape", "shape"), ("ms", "ms"), ("eager_ms", "eager ms"),
                              ("gb_s", "GB/s"), ("pct_copy", "%copy"), ("tflop_s", "TFLOP/s"),
                              ("pct_matmul", "%mm"), ("kernel_pct_matmul", "kern %mm"),
                              ("gemm_tflop_s", "GEMM TFLOP/s"),
                              ("copy_time_ratio", "t/t_copy"), ("speedup_vs_twin", "x twin"),
                              ("bf16_over_fp8", "bf16/fp8"), ("ref_ms", "ref ms"),
                              ("max_err_vs_ref", "err")])


if __name__ == "__main__":
    main()
