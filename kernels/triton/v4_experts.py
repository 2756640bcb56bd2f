"""DeepSeek-V4's experts: fused MoE GEMMs with the clamped SwiGLU (`swiglu_limit`), reading only chosen experts.

The reference runs every expert over every row (E launches of GEMMs, every expert's
weights read whatever the routing). This is the tiled fused MoE of `moe` (pairs
sorted by expert, one expert per program's rows) with its own gate/up kernel, which
clamps the pre-activations before the SwiGLU: gate at `limit` from above, up to
[-limit, limit]. Alignment, the down projection (scaled by the router weight into
float32 pair rows) and the k-way combine are `moe`'s kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import check_float, dot_precision, next_pow2, pdl
from .moe import _combine_kernel, _down_kernel, tiled_config
from .moe_align import block_routing, moe_align, moe_sorted_size

# Up to this many (token, slot) pairs the gate/up programs sort the pairs themselves (as `moe` does).
_INLINE_ALIGN_MAX_PAIRS = 64


@triton.jit
def _clamped_gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, sorted_ptr, block_expert_ptr, act_ptr,
    num_pairs, num_experts, hidden, inter, limit,
    s_xt, s_xd, s_we, s_wn, s_wd, s_ar, s_ai, s_ids_t, s_ids_k,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INLINE_ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
    GDC: tl.constexpr,
):
    block = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    if INLINE_ALIGN:
        expert, pairs = block_routing(ids_ptr, s_ids_t, s_ids_k, block, num_pairs, num_experts,
                                       TOP_K, BLOCK_M, BLOCK_E, BLOCK_P)
        if tl.program_id(1) == 0:
            tl.store(sorted_ptr + rows, pairs.to(tl.int32))
            tl.store(block_expert_ptr + block, expert.to(tl.int32))
    else:
        expert = tl.load(block_expert_ptr + block)
        pairs = tl.load(sorted_ptr + rows)
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
            w_mask = (ks[:, None] < hidden) & col_mask[None, :]
            gate = tl.load(w_gate + ks[:, None] * s_wd, mask=w_mask, other=0.0)
            up = tl.load(w_up + ks[:, None] * s_wd, mask=w_mask, other=0.0)
            acc_gate = tl.dot(xa, gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xa, up, acc_up, input_precision=DOT_PRECISION)
        # The pre-activations are rounded to x's dtype first, as the reference's projections are.
        g = tl.minimum(acc_gate.to(act_ptr.dtype.element_ty).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(acc_up.to(act_ptr.dtype.element_ty).to(tl.float32), -limit), limit)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(act_ptr + rows[:, None].to(tl.int64) * s_ar + cols[None, :] * s_ai,
                 act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def clamped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, limit: float) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with clamped SwiGLU (see
    `reference.v4_moe.clamped_experts`): x [T, D]; w13 [E, 2I, D]; w2 [E, D, I]; topk_weights [T, k]
    (any float dtype); topk_ids [T, k] int (-1: none) -> [T, D] in x's dtype. Products and the k-way
    sum in float32."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    check_float("x", x)
    check_shape("w13", w13, (num_experts, 2 * inter, hidden))
    check_shape("w2", w2, (num_experts, hidden, inter))
    check_shape("topk_ids", topk_ids, (num_tokens, None))
    top_k = topk_ids.shape[1]
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype("w13", w13, (x.dtype,))
    check_dtype("w2", w2, (x.dtype,))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_float("topk_weights", topk_weights)
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    device = x.device
    num_pairs = num_tokens * top_k
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=device)
    if num_pairs == 0:
        return out.zero_()
    weights = topk_weights.float()
    config = tiled_config(num_pairs, num_experts, device, x.dtype)
    bm = config.block_m
    num_rows = moe_sorted_size(num_pairs, num_experts, bm)
    num_blocks = num_rows // bm
    inline_align = num_pairs <= _INLINE_ALIGN_MAX_PAIRS
    if inline_align:
        sorted_pairs = torch.empty(num_rows, dtype=torch.int32, device=device)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    else:
        sorted_pairs, block_expert = moe_align(topk_ids, num_experts, bm)
    precision = dot_precision(x.dtype)
    use_pdl = pdl(device)
    act = torch.empty((num_rows, inter), dtype=x.dtype, device=device)
    _clamped_gate_up_kernel[(num_blocks, triton.cdiv(inter, config.block_n))](
        x, w13, topk_ids, sorted_pairs, block_expert, act,
        num_pairs, num_experts, hidden, inter, limit,
        *x.stride(), *w13.stride(), *act.stride(), *topk_ids.stride(),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_PRECISION=precision,
        INLINE_ALIGN=inline_align, BLOCK_E=max(2, next_pow2(num_experts)),
        BLOCK_P=max(2, next_pow2(num_pairs)) if inline_align else 2, GDC=use_pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, config.block_n))](
        act, w2, sorted_pairs, block_expert, weights, pair_out,
        num_pairs, hidden, inter,
        *act.stride(), *w2.stride(), *weights.stride(), pair_out.stride(0),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=inter % config.block_k == 0, EVEN_N=hidden % config.block_n == 0,
        DOT_PRECISION=precision, GDC=use_pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    block_d = min(1024, next_pow2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        pair_out, topk_ids, out,
        hidden, pair_out.stride(0), *topk_ids.stride(), out.stride(0),
        TOP_K=top_k, BLOCK_D=block_d, GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
    return out
