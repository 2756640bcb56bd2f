"""Fused mixture-of-experts over block-scaled FP8 experts: `reference.fp8.fp8_fused_moe`.

The tiled path of `moe` with FP8 weight tiles: the pairs sorted by expert (`moe_align`, or inside
the gate/up programs for few pairs), gate/up, down into a float32 row per (token, slot) pair, and
`moe.combine_pairs`. Each K step lies inside one scale block and its tensor-core product is added
to the accumulator times the weight block's scale per output column (and with w8a8 the
activation group's scale per row), as in `fp8_linear`. With w8a8, x is quantized once per token
before gate/up (`fp8_quant`), and the gate/up programs quantize the activation they write, one
group of bk columns a program, for the down product; otherwise x and the activation stay 16-bit
and each weight tile is widened to them in registers (with `Fp8MoeConfig.lift`, bf16 rows meet the
tile as fp16, lifted exactly by a power of two a row and K step: `fp16_lift`, as the FP8 weight stream
does, since e4m3 widens to fp16 in fewer instructions than to bf16). Few pairs of 16-bit activations
(decode) take the per-pair path instead (`fp8_moe_pairs`, one launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device
from ..reference.fp8 import DEFAULT_BLOCK, FP8_DTYPE, check_fp8_moe, check_scale_fmt
from ._common import FLOAT_DTYPES, TL_DTYPES, check_float, dot_precision, h200, next_pow2, pdl
from .fp16_lift import lift_to_fp16
from .fp8_linear import check_block_k, scaled_dot
from .fp8_moe_pairs import FP8_PAIR_MAX_PAIRS, fp8_pair_config, fp8_pair_moe, pair_block_i
from .fp8_quant import quantize_activations, quantize_tile
from .moe import combine_pairs
from .moe_pairs import PairConfig
from .moe_align import gate_up_block, moe_align, moe_sorted_size
from .swiglu import swiglu_activation


@dataclass(frozen=True, slots=True)
class Fp8MoeConfig:
    block_m: int   # sorted rows per program (one expert each)
    block_n: int   # output columns per program
    block_k: int   # reduction step, at most the scale block's K
    num_warps: int
    num_stages: int
    lift: bool = False  # bf16 rows lifted to fp16 against the FP8 tiles (16-bit activations only)


# Decode: a row or two per expert, so the GEMMs stream the chosen experts' weights; 64-wide
# column tiles give every multiprocessor programs, and 8 warps share the widening of each FP8
# tile (H100, V3's experts, 32 experts top-8, graph replays: 1 token 146 us, 80% of the copy rate,
# against 188 us with 4 warps; 16 tokens 86% either way). Lifting the rows to fp16 gained 2-8
# points of the copy rate where an expert has 4-16 rows, nothing at 1-2 rows (ef8e76f).
# Prefill: still few rows an expert (1024 tokens of V3 are 32 rows an expert), so the widening of
# each FP8 tile, not the products, sets the pace: 32-row tiles with 8 warps and the fp16 lift ran
# 1.3-2.3x faster than 64-row tiles with 4 warps at 512-4096 tokens of V3's and v2-lite's experts
# (H100, bench/notes/fp8.md).
_GPU_DECODE = Fp8MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=8, num_stages=4, lift=True)
# On an H200 (24 decode tiles, V3's 32 experts, graph replays; bench/results/kernels/h200/logs-archive/
# fp8-moe-tiles-h200-2026-11-28.log) 128-wide column tiles over 4 warps: 16 tokens 358 us (91% of copy)
# against 438 (75%) for the H100's tiles, 64 tokens 432 against 618.
_H200_DECODE = Fp8MoeConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, lift=True)
_GPU_PREFILL = Fp8MoeConfig(block_m=32, block_n=128, block_k=128, num_warps=8, num_stages=3, lift=True)
_INTERPRETER = Fp8MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, lift=True)
# Up to this many (token, slot) pairs the gate/up programs sort them themselves.
_INLINE_ALIGN_MAX_PAIRS = 64


def fp8_moe_config(num_pairs: int, num_experts: int, device: torch.device, *,
                   w8a8: bool = False) -> Fp8MoeConfig | PairConfig:
    """The launch configuration, and so the path, for num_pairs = T * k pairs over num_experts experts:
    up to FP8_PAIR_MAX_PAIRS pairs of 16-bit activations the per-pair path (`fp8_moe_pairs`: one launch, where
    the tiled path's 16-row tiles hold one live row each)."""
    if not w8a8 and num_pairs <= FP8_PAIR_MAX_PAIRS:
        return fp8_pair_config(device)
    if device.type != "cuda":
        return _INTERPRETER
    if num_pairs > 16 * num_experts:
        return _GPU_PREFILL
    return _H200_DECODE if h200(device) else _GPU_DECODE


# Tile pieces the quantized expert kernels share (this module's and `fp4_experts`').

@triton.jit
def gate_up_program(ids_ptr, sorted_ptr, block_expert_ptr, s_ids_t, s_ids_k, num_pairs, num_experts, inter,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INLINE_ALIGN: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """A gate/up program's expert (-1: an unused block), sorted rows and columns (`moe_align.gate_up_block`):
    (expert, rows, row_mask, each row's token (0 for padding), the output columns and their mask, the gate
    rows [0, I) and up rows [I, 2I) of w13 they read; columns past I read row 0 and are not stored)."""
    block = tl.program_id(0)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    expert, pairs = gate_up_block(ids_ptr, sorted_ptr, block_expert_ptr, s_ids_t, s_ids_k, block, num_pairs,
                                  num_experts, TOP_K, BLOCK_M, INLINE_ALIGN, BLOCK_E, BLOCK_P)
    row_mask = pairs < num_pairs
    tokens = tl.where(row_mask, pairs // TOP_K, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    gate_rows = tl.where(col_mask, cols, 0)
    return expert, rows, row_mask, tokens, cols, col_mask, gate_rows, gate_rows + inter


@triton.jit
def down_rows(sorted_ptr, num_pairs, hidden, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A down program's sorted rows and columns: (rows, their pairs, row_mask, the output columns, their
    mask, the w2 rows they read: row 0 past D)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    return rows, pairs, pairs < num_pairs, cols, col_mask, tl.where(col_mask, cols, 0)


@triton.jit
def store_weighted_pairs(acc, weights_ptr, pair_out_ptr, pairs, row_mask, cols, col_mask, s_tw_t, s_tw_k, s_pr,
                         TOP_K: tl.constexpr):
    """Each row's down product times its pair's router weight, into its float32 pair row."""
    router = tl.load(weights_ptr + (pairs // TOP_K) * s_tw_t + (pairs % TOP_K) * s_tw_k, mask=row_mask, other=0.0)
    tl.store(pair_out_ptr + pairs[:, None].to(tl.int64) * s_pr + cols[None, :], acc * router[:, None],
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def lifted_dot(a16, unscale, w, acc, w_scale):
    """acc + (a @ w) * w_scale[None, :] for a == a16 * unscale[:, None] (`lift_to_fp16` along its rows):
    a16 [M, K] fp16, w [K, N] FP8 widened to fp16, the row's power of two undone on the float32 product."""
    return acc + tl.dot(a16, w.to(tl.float16)) * (unscale[:, None] * w_scale[None, :])


def sorted_rows(topk_ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[int, bool, torch.Tensor, torch.Tensor]:
    """The pairs of topk_ids [T, k] sorted by expert in runs of block_m rows: (the blocks of rows, whether the
    gate/up programs sort them themselves (few pairs), sorted pairs [blocks * block_m] int32, each block's
    expert [blocks] int32; the last two left for the gate/up programs to fill when they sort)."""
    num_pairs = topk_ids.numel()
    num_rows = moe_sorted_size(num_pairs, num_experts, block_m)
    if num_pairs <= _INLINE_ALIGN_MAX_PAIRS:
        return (num_rows // block_m, True, torch.empty(num_rows, dtype=torch.int32, device=topk_ids.device),
                torch.empty(num_rows // block_m, dtype=torch.int32, device=topk_ids.device))
    sorted_pairs, block_expert = moe_align(topk_ids, num_experts, block_m)
    return num_rows // block_m, False, sorted_pairs, block_expert


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    a_ptr, as_ptr, w13_ptr, ws_ptr, ids_ptr, sorted_ptr, block_expert_ptr, act_ptr, act_scale_ptr,
    num_pairs, num_experts, hidden, inter, limit,
    s_at, s_ad, s_ast, s_asb, s_we, s_wn, s_wd, s_wse, s_wsn, s_wsb, s_ar, s_ai, s_asr, s_asg, s_ids_t, s_ids_k,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, W8A8: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INLINE_ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, X_DTYPE: tl.constexpr,
    GDC: tl.constexpr, CLAMP: tl.constexpr, LIFT: tl.constexpr, UE8M0: tl.constexpr,
):
    if GDC:
        gdc_wait()
    expert, rows, row_mask, tokens, cols, col_mask, gate_rows, up_rows = gate_up_program(
        ids_ptr, sorted_ptr, block_expert_ptr, s_ids_t, s_ids_k, num_pairs, num_experts, inter,
        TOP_K, BLOCK_M, BLOCK_N, INLINE_ALIGN, BLOCK_E, BLOCK_P)
    if expert >= 0:
        # A scale block may straddle the gate and up rows.
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + tokens[:, None] * s_at
        w_expert = w13_ptr + expert.to(tl.int64) * s_we
        s_expert = ws_ptr + expert.to(tl.int64) * s_wse
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < hidden
            a = tl.load(a_rows + ks[None, :] * s_ad, mask=k_mask[None, :], other=0.0)
            gate = tl.load(w_expert + gate_rows[None, :] * s_wn + ks[:, None] * s_wd, mask=k_mask[:, None], other=0.0)
            up = tl.load(w_expert + up_rows[None, :] * s_wn + ks[:, None] * s_wd, mask=k_mask[:, None], other=0.0)
            kb = k0 // SCALE_K
            gate_scale = tl.load(s_expert + (gate_rows // SCALE_N) * s_wsn + kb * s_wsb)
            up_scale = tl.load(s_expert + (up_rows // SCALE_N) * s_wsn + kb * s_wsb)
            if LIFT:
                a16, unscale = lift_to_fp16(a, 1)
                acc_gate = lifted_dot(a16, unscale, gate, acc_gate, gate_scale)
                acc_up = lifted_dot(a16, unscale, up, acc_up, up_scale)
            else:
                a_scale = gate_scale
                if W8A8:
                    a_scale = tl.load(as_ptr + tokens * s_ast + kb * s_asb)
                acc_gate = scaled_dot(a, gate, acc_gate, a_scale, gate_scale, W8A8, DOT_PRECISION)
                acc_up = scaled_dot(a, up, acc_up, a_scale, up_scale, W8A8, DOT_PRECISION)
        if GDC:
            gdc_launch_dependents()
        act = swiglu_activation(acc_gate, acc_up, limit, X_DTYPE, CLAMP)
        out_mask = row_mask[:, None] & col_mask[None, :]
        if W8A8:
            # One program's columns are one quantization group of the down product's input:
            # columns past I (read from row 0) are zeroed so that they do not count in its scale.
            values, scales = quantize_tile(tl.where(col_mask[None, :], act.to(tl.float32), 0.0), UE8M0)
            tl.store(act_ptr + rows[:, None].to(tl.int64) * s_ar + cols[None, :] * s_ai, values, mask=out_mask)
            tl.store(act_scale_ptr + rows * s_asr + tl.program_id(1) * s_asg, scales, mask=row_mask)
        else:
            tl.store(act_ptr + rows[:, None].to(tl.int64) * s_ar + cols[None, :] * s_ai, act, mask=out_mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    a_ptr, as_ptr, w2_ptr, ws_ptr, sorted_ptr, block_expert_ptr, weights_ptr, pair_out_ptr,
    num_pairs, hidden, inter,
    s_ar, s_ai, s_asr, s_asb, s_we, s_wn, s_wk, s_wse, s_wsn, s_wsb, s_tw_t, s_tw_k, s_pr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, W8A8: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GDC: tl.constexpr, LIFT: tl.constexpr,
):
    block = tl.program_id(0)
    if GDC:
        gdc_wait()
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows, pairs, row_mask, cols, col_mask, out_rows = down_rows(sorted_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rows[:, None].to(tl.int64) * s_ar
        w_cols = w2_ptr + expert.to(tl.int64) * s_we + out_rows[None, :] * s_wn
        s_cols = ws_ptr + expert.to(tl.int64) * s_wse + (out_rows // SCALE_N) * s_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < inter
            a = tl.load(a_rows + ks[None, :] * s_ai, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None] * s_wk, mask=k_mask[:, None], other=0.0)
            kb = k0 // SCALE_K
            w_scale = tl.load(s_cols + kb * s_wsb)
            if LIFT:
                a16, unscale = lift_to_fp16(a, 1)
                acc = lifted_dot(a16, unscale, w, acc, w_scale)
            else:
                a_scale = w_scale
                if W8A8:
                    a_scale = tl.load(as_ptr + rows * s_asr + kb * s_asb, mask=row_mask, other=0.0)
                acc = scaled_dot(a, w, acc, a_scale, w_scale, W8A8, DOT_PRECISION)
        if GDC:
            gdc_launch_dependents()
        store_weighted_pairs(acc, weights_ptr, pair_out_ptr, pairs, row_mask, cols, col_mask, s_tw_t, s_tw_k, s_pr,
                             TOP_K)


def fp8_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block: tuple[int, int] = DEFAULT_BLOCK,
    w8a8: bool = False,
    out_dtype: torch.dtype | None = None,
    config: Fp8MoeConfig | PairConfig | None = None,
    limit: float | None = None,
    scale_fmt: str = "fp32",
) -> torch.Tensor:
    """Contract of `reference.fp8.fp8_fused_moe`: the sum over each token's chosen experts of
    weight * down(silu(gate(x)) * up(x)) with block-scaled FP8 expert weights.

    x:             [T, D] bf16 / fp16 / fp32 (any strides)
    w13:           [E, 2I, D] float8_e4m3fn; w13_scale_inv [E, ceil(2I/bn), ceil(D/bk)] float32
    w2:            [E, D, I] float8_e4m3fn; w2_scale_inv [E, ceil(D/bn), ceil(I/bk)] float32
    topk_weights:  [T, k] float32; topk_ids [T, k] int32 / int64 in [-1, E) (-1: no expert;
                   ids >= E are not checked, which would need a host sync)
    block:         (bn, bk), bk a power of two >= 32
    returns        [T, D] in out_dtype (x's by default). The activation is kept in x's dtype,
                   products and the k-way sum in float32. `config` overrides `fp8_moe_config` (a
                   `PairConfig` takes the per-pair path, whose float32 atomics add the k terms in an
                   order, and so to last bits, that may differ from run to run).
    limit:         DeepSeek-V4's `swiglu_limit`, or None: the gate and up pre-activations, rounded to x's
                   dtype, are clamped (gate from above, up both ways) before the SwiGLU, as
                   `reference.v4_moe.clamped_experts` does (its contract on FP8 experts).
    scale_fmt:     how w8a8 scales the activations it quantizes (`reference.fp8.quantize_activations`).
    """
    num_tokens, hidden = x.shape
    num_experts = check_fp8_moe(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block)
    check_block_k(block)
    check_scale_fmt(scale_fmt)
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    check_float("x", x)
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_same_device(x=x, w13=w13, w13_scale_inv=w13_scale_inv, w2=w2, w2_scale_inv=w2_scale_inv,
                      topk_weights=topk_weights, topk_ids=topk_ids)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {FLOAT_DTYPES}, got {out_dtype}")
    device = x.device
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=out_dtype, device=device)
    c = config or fp8_moe_config(num_pairs, num_experts, device, w8a8=w8a8)
    if isinstance(c, PairConfig):
        if w8a8:
            raise ValueError("config: the per-pair path takes 16-bit activations, got w8a8=True")
        pair_sum = fp8_pair_moe(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block=block,
                                block_i=pair_block_i(c, block), config=c, limit=limit)
        return pair_sum if out_dtype == torch.float32 else pair_sum.to(out_dtype)
    block_k = min(c.block_k, block[1])
    bm = c.block_m
    num_blocks, inline_align, sorted_pairs, block_expert = sorted_rows(topk_ids, num_experts, bm)
    num_rows = num_blocks * bm

    a, a_scales = quantize_activations(x, block[1], scale_fmt=scale_fmt) if w8a8 else (x, w13_scale_inv[0])
    precision = dot_precision(x.dtype)
    lift = c.lift and not w8a8 and x.dtype == torch.bfloat16
    use_pdl = pdl(device)
    # With w8a8 the gate/up programs quantize the activation for the down product themselves,
    # one group of bk columns a program.
    gate_up_n = block[1] if w8a8 else c.block_n
    act = torch.empty((num_rows, inter), dtype=FP8_DTYPE if w8a8 else x.dtype, device=device)
    act_scales = torch.empty((num_rows, triton.cdiv(inter, block[1])) if w8a8 else (1, 1), dtype=torch.float32,
                             device=device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, gate_up_n))](
        a, a_scales, w13, w13_scale_inv, topk_ids, sorted_pairs, block_expert, act, act_scales,
        num_pairs, num_experts, hidden, inter, 0.0 if limit is None else float(limit),
        *a.stride(), *a_scales.stride(), *w13.stride(), *w13_scale_inv.stride(), *act.stride(), *act_scales.stride(),
        *topk_ids.stride(),
        SCALE_N=block[0], SCALE_K=block[1], W8A8=w8a8, TOP_K=top_k,
        BLOCK_M=bm, BLOCK_N=gate_up_n, BLOCK_K=block_k, DOT_PRECISION=precision,
        # BLOCK_P only sizes the inline sort; elsewhere a fixed value, or every new
        # power of two of pairs in an eager step would compile another variant.
        INLINE_ALIGN=inline_align, BLOCK_E=max(2, next_pow2(num_experts)),
        BLOCK_P=max(2, next_pow2(num_pairs)) if inline_align else 2, X_DTYPE=TL_DTYPES[x.dtype], GDC=use_pdl,
        CLAMP=limit is not None, LIFT=lift, UE8M0=w8a8 and scale_fmt == "ue8m0", num_warps=c.num_warps,
        num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    d_scales = act_scales if w8a8 else w2_scale_inv[0]
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, c.block_n))](
        act, d_scales, w2, w2_scale_inv, sorted_pairs, block_expert, topk_weights, pair_out,
        num_pairs, hidden, inter,
        *act.stride(), *d_scales.stride(), *w2.stride(), *w2_scale_inv.stride(), *topk_weights.stride(),
        pair_out.stride(0),
        SCALE_N=block[0], SCALE_K=block[1], W8A8=w8a8, TOP_K=top_k,
        BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=block_k, DOT_PRECISION=precision, GDC=use_pdl, LIFT=lift,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=device)
    combine_pairs(pair_out, topk_ids, out)
    return out
