"""Fused mixture-of-experts: expert GEMMs that read only the chosen experts' weights.

Two paths, both with static grids sized from T * k and E, and nothing read back
to the host, so either can be captured in a graph.

Per pair (at most PAIR_MAX_PAIRS (token, slot) pairs: decode at batch 1 or 2),
one launch: `moe_pairs`.

Tiled (more pairs), here: six launches (three for at most 64 pairs):

1. `moe_align.moe_align` (three small launches; folded into the next kernel
   for few pairs): the pairs sorted by expert in runs of BLOCK_M rows.
2. `_gate_up_kernel`: act = silu(x @ W_gate^T) * (x @ W_up^T) per sorted row.
3. `_down_kernel`: act @ W_down^T, scaled by the pair's router weight, into a
   float32 row per (token, slot) pair.
4. `_combine_kernel`: sums each token's k pair rows, skipping ids of -1.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import FLOAT_DTYPES, check_float, dot_precision, next_pow2, pdl
from .moe_align import gate_up_block, moe_align, moe_sorted_size
from .moe_pairs import PAIR_MAX_PAIRS, PairConfig, pair_config, pair_moe


@dataclass(frozen=True, slots=True)
class MoeConfig:
    block_m: int   # sorted rows per program (one expert each)
    block_n: int   # output columns per program
    block_k: int   # reduction step
    num_warps: int
    num_stages: int
    down_stages: int = 0   # the down kernel's pipeline depth where it differs (0: num_stages)


# Chosen for V2-Lite shapes (D=2048, I=1408, bf16). Decode: few live rows per expert,
# so the GEMMs stream weights. 64-wide column tiles still give every multiprocessor
# programs: H200, 64 routed + 2 shared experts, top-6 + 2, batch 8: 166 us a layer
# (gate/up 108, down 54; ~3.8 TB/s of the 4.24 copy) against 175 with 32-wide tiles;
# batch 64 281 vs 285 (bench/results/dsa-kernels/h200/logs-archive/moe-topk-sweep-h200-2026-11-24.log). Prefill:
# 64-row tiles (H100: 1.62 ms at 2048 tokens; 128-row tiles 1.73-2.64 ms).
_GPU_DECODE = MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
_GPU_PREFILL = MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
# Between the two (at most one 64-row tile per expert on average: V4's batch 64 over
# 8 + 1 experts of 4096 x 2048) there are too few row tiles for 128-wide columns to
# cover the multiprocessors: 64-wide ones double the programs (H200: 143 us vs 152 us
# for 8 experts, 40 us vs 61 us for one; bench/results/v4-step/h200/logs-archive/moe-sweep-h200-2026-11-23.log).
# 64-deep K steps keep three stages in half the shared memory, so more programs stay
# resident: 142 us against 154 with 128-deep ones for V4's batch 64, top-6 + 1
# (bench/results/v4-step/h200/logs-archive/v4-moe-b64-sweep-h200-2026-11-24.log). The down kernel reads one weight
# tile a step where gate/up reads two, so it takes a stage more to keep as many bytes in flight:
# H100, V4's batch 64, the down kernel alone 62.2 us against 69.2 at three stages, v4-mini's B64 x 64K
# step 2.52 ms against 2.53-2.54 (gate/up gains nothing from a fourth;
# bench/results/v4-step/h100/logs-archive/moe-down-stages-h100-2026-11-26.log).
_GPU_FEW_ROWS = MoeConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, down_stages=4)
_INTERPRETER = MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


# Up to this many (token, slot) pairs the GEMM programs sort them themselves.
_INLINE_ALIGN_MAX_PAIRS = 64


def tiled_config(num_pairs: int, num_experts: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16) -> MoeConfig:
    """The tiled path's launch configuration for num_pairs = T * k pairs."""
    if device.type != "cuda":
        return _INTERPRETER
    # Rows per expert on average; below a 16-row tile the tall config only pads.
    if num_pairs <= 16 * num_experts:
        config = _GPU_DECODE
    elif num_pairs <= 64 * num_experts:
        config = _GPU_FEW_ROWS
    else:
        config = _GPU_PREFILL
    # float32 tiles take twice the shared memory: one stage less keeps them in it.
    return replace(config, num_stages=2, down_stages=0) if dtype == torch.float32 else config


def moe_config(num_pairs: int, num_experts: int, device: torch.device,
               dtype: torch.dtype = torch.bfloat16) -> MoeConfig | PairConfig:
    """The launch configuration, and so the path, `fused_moe` takes by default for T * k pairs."""
    if num_pairs <= PAIR_MAX_PAIRS:
        return pair_config(device)
    return tiled_config(num_pairs, num_experts, device, dtype)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, sorted_ptr, block_expert_ptr, act_ptr,
    num_pairs, num_experts, hidden, inter, limit,
    s_xt, s_xd, s_we, s_wn, s_wd, s_ar, s_ai, s_ids_t, s_ids_k,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INLINE_ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, GDC: tl.constexpr,
    CLAMP: tl.constexpr = False,
):
    block = tl.program_id(0)
    if GDC:
        gdc_wait()
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    expert, pairs = gate_up_block(ids_ptr, sorted_ptr, block_expert_ptr, s_ids_t, s_ids_k, block, num_pairs,
                                  num_experts, TOP_K, BLOCK_M, INLINE_ALIGN, BLOCK_E, BLOCK_P)
    if expert >= 0:
        row_mask = pairs < num_pairs
        tokens = (pairs // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < inter
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + tokens[:, None] * s_xt
        w_gate = w13_ptr + expert.to(tl.int64) * s_we + cols[None, :] * s_wn
        w_up = w_gate + inter * s_wn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + offs_k
            xa = tl.load(x_rows + ks[None, :] * s_xd, mask=row_mask[:, None] & (ks[None, :] < hidden), other=0.0)
            if EVEN_K and EVEN_N:
                gate = tl.load(w_gate + ks[:, None] * s_wd)
                up = tl.load(w_up + ks[:, None] * s_wd)
            else:
                w_mask = (ks[:, None] < hidden) & col_mask[None, :]
                gate = tl.load(w_gate + ks[:, None] * s_wd, mask=w_mask, other=0.0)
                up = tl.load(w_up + ks[:, None] * s_wd, mask=w_mask, other=0.0)
            acc_gate = tl.dot(xa, gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xa, up, acc_up, input_precision=DOT_PRECISION)
        if GDC:
            # After the weights' loop, not at the start: the next kernel's programs, launched at our
            # first wave, would sit waiting beside our later waves (H200, v4-mini batch 1: 1.20 ms a
            # step against 1.21). Programs without an expert exit, which releases them as well.
            gdc_launch_dependents()
        if CLAMP:
            # DeepSeek-V4's clamped SwiGLU: the pre-activations rounded to x's dtype first, as
            # the reference's projections are, then the gate clamped from above, up both ways.
            acc_gate = tl.minimum(acc_gate.to(act_ptr.dtype.element_ty).to(tl.float32), limit)
            acc_up = tl.minimum(tl.maximum(acc_up.to(act_ptr.dtype.element_ty).to(tl.float32), -limit), limit)
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        tl.store(act_ptr + rows[:, None].to(tl.int64) * s_ar + cols[None, :] * s_ai,
                 act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, w2_ptr, sorted_ptr, block_expert_ptr, weights_ptr, pair_out_ptr,
    num_pairs, hidden, inter,
    s_ar, s_ai, s_we, s_wn, s_wk, s_tw_t, s_tw_k, s_pr,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, GDC: tl.constexpr,
):
    block = tl.program_id(0)
    if GDC:
        gdc_wait()
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ptr + rows)
        row_mask = pairs < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < hidden
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = act_ptr + rows[:, None].to(tl.int64) * s_ar
        w_cols = w2_ptr + expert.to(tl.int64) * s_we + cols[None, :] * s_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + offs_k
            a = tl.load(a_rows + ks[None, :] * s_ai, mask=row_mask[:, None] & (ks[None, :] < inter), other=0.0)
            if EVEN_K and EVEN_N:
                w = tl.load(w_cols + ks[:, None] * s_wk)
            else:
                w = tl.load(w_cols + ks[:, None] * s_wk, mask=(ks[:, None] < inter) & col_mask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GDC:
            gdc_launch_dependents()
        router = tl.load(weights_ptr + (pairs // TOP_K) * s_tw_t + (pairs % TOP_K) * s_tw_k, mask=row_mask, other=0.0)
        acc = acc * router[:, None]
        tl.store(pair_out_ptr + pairs[:, None].to(tl.int64) * s_pr + cols[None, :], acc,
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _combine_kernel(
    pair_out_ptr, ids_ptr, out_ptr,
    hidden, s_pr, s_ids_t, s_ids_k, s_ot,
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < hidden
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # A pair with id -1 was never written by the down kernel: skip its row.
        expert = tl.load(ids_ptr + token * s_ids_t + j * s_ids_k)
        chosen = col_mask & (tl.zeros([BLOCK_D], dtype=expert.dtype) + expert >= 0)
        total += tl.load(pair_out_ptr + (token * TOP_K + j) * s_pr + cols, mask=chosen, other=0.0)
    tl.store(out_ptr + token * s_ot + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    config: MoeConfig | PairConfig | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * down(silu(gate(x)) * up(x)).

    x:            [T, D] bf16 / fp16 / fp32 (any strides)
    w13:          [E, 2I, D], rows [0, I) gate, [I, 2I) up; same dtype as x
    w2:           [E, D, I], same dtype as x
    topk_weights: [T, k] float32
    topk_ids:     [T, k] int32 / int64 in [-1, E); -1 takes no expert (padded rows).
                  Ids >= E are not checked (that would need a host sync).
    out_dtype:    dtype of the result, by default x's
    config:       a `MoeConfig` (tiled path) or `PairConfig` (per-pair path); by
                  default `moe_config(T * k, E, ...)`
    returns       [T, D] in out_dtype. Intermediates: act in x's dtype, products
                  and the k-way sum in float32.

    The per-pair path adds partial sums with float32 atomics, so the order of the
    additions, and the last bits of the sum, may differ from run to run.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    check_shape("w13", w13, (num_experts, 2 * inter, hidden))
    check_shape("w2", w2, (num_experts, hidden, inter))
    check_shape("topk_ids", topk_ids, (num_tokens, None))
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    check_float("x", x)
    check_dtype("w13", w13, (x.dtype,))
    check_dtype("w2", w2, (x.dtype,))
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {FLOAT_DTYPES}, got {out_dtype}")
    device = x.device
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=out_dtype, device=device)
    config = config or moe_config(num_pairs, num_experts, device, x.dtype)
    if isinstance(config, PairConfig):
        out = pair_moe(x, w13, w2, topk_weights, topk_ids, config)
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    return tiled_moe(x, w13, w2, topk_weights, topk_ids, config, out_dtype)


def tiled_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: MoeConfig, out_dtype: torch.dtype, *, limit: float | None = None) -> torch.Tensor:
    """The tiled path: (align,) gate/up, down and combine launches. With `limit`, the SwiGLU's
    pre-activations are clamped (DeepSeek-V4's `swiglu_limit`). Arguments as `fused_moe` checks them."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    device = x.device
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=device)
    bm = config.block_m
    num_rows = moe_sorted_size(num_pairs, num_experts, bm)
    num_blocks = num_rows // bm

    block_e = max(2, next_pow2(num_experts))
    inline_align = num_pairs <= _INLINE_ALIGN_MAX_PAIRS
    if inline_align:
        sorted_pairs = torch.empty(num_rows, dtype=torch.int32, device=device)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    else:
        sorted_pairs, block_expert = moe_align(topk_ids, num_experts, bm)

    precision = dot_precision(x.dtype)
    use_pdl = pdl(device)
    act = torch.empty((num_rows, inter), dtype=x.dtype, device=device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, config.block_n))](
        x, w13, topk_ids, sorted_pairs, block_expert, act,
        num_pairs, num_experts, hidden, inter, 0.0 if limit is None else float(limit),
        *x.stride(), *w13.stride(), *act.stride(), *topk_ids.stride(),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=hidden % config.block_k == 0, EVEN_N=inter % config.block_n == 0,
        DOT_PRECISION=precision,
        # BLOCK_P only sizes the inline sort; elsewhere a fixed value, or every new
        # power of two of pairs in an eager step would compile another variant.
        INLINE_ALIGN=inline_align, BLOCK_E=block_e,
        BLOCK_P=max(2, next_pow2(num_pairs)) if inline_align else 2, GDC=use_pdl, CLAMP=limit is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, config.block_n))](
        act, w2, sorted_pairs, block_expert, topk_weights, pair_out,
        num_pairs, hidden, inter,
        *act.stride(), *w2.stride(), *topk_weights.stride(), pair_out.stride(0),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=inter % config.block_k == 0, EVEN_N=hidden % config.block_n == 0,
        DOT_PRECISION=precision, GDC=use_pdl,
        num_warps=config.num_warps, num_stages=config.down_stages or config.num_stages, launch_pdl=use_pdl,
    )
    combine_pairs(pair_out, topk_ids, out)
    return out


def combine_pairs(pair_out: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, D] (contiguous rows) = the sum over each token's k rows of pair_out [T * k, D] float32,
    skipping slots whose id in topk_ids [T, k] is -1 (rows the down kernel never wrote)."""
    num_tokens, hidden = out.shape
    block_d = min(1024, next_pow2(hidden))
    use_pdl = pdl(out.device)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        pair_out, topk_ids, out,
        hidden, pair_out.stride(0), *topk_ids.stride(), out.stride(0),
        TOP_K=topk_ids.shape[1], BLOCK_D=block_d, GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
