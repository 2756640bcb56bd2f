"""DeepSeek-V4's FP4 routed experts as fp16 tensor-core products: e2m1 tiles widened through e4m3.

The tiled fused MoE of `fp4_experts` (pairs sorted by expert, one expert per program's rows; gate/up
with the clamped SwiGLU, down scaled by the router weight, the k-way sum by `moe.combine_pairs`), with
the FP4 tile met differently. `fp4_experts` hands the packed bytes to `tl.dot_scaled`, which on Hopper
widens each e2m1 value to bf16 in registers before the product; here each byte's two codes become two
fp16 values through e4m3 (`e2m1_widen`: bit operations on whole words and one conversion for two
values), the low nibbles (the even columns of K) and the high ones (the odd) as two tiles, each in a
product with the matching columns of the activations. So the activations meet the weight as fp16:
bf16 rows are lifted exactly by a power of two a row and K step (`fp16_lift`; the activations by a
pass first, the SwiGLU output by the gate/up programs as they store it), undone on the float32 sums.
Each 32-value group's e8m0 scale (2^(byte - 127)) multiplies its float32 product, as `fp8_linear`
applies block scales.

Every product of a widened value and a lifted activation is exact and summed in float32, so the
result is the reference's math (`BlockFP4Weight.dequantize`, then a bf16 product with float32 sums)
in another order of addition; the pre-activations and the activation round to bf16 as there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..fp4_weight import BlockFP4Weight
from ._common import next_pow2, pdl
from .e2m1_widen import E2M1_UNDO, e2m1_to_fp16
from .fp16_lift import lift_to_fp16, lifted_rows
from .fp8_moe import down_rows, gate_up_program, sorted_rows, store_weighted_pairs
from .moe import combine_pairs
from .swiglu import swiglu_activation

# Values one e8m0 scale covers along K (and as constexprs for the kernels).
GROUP = 32
_GROUP = tl.constexpr(GROUP)
_HALF_GROUP = tl.constexpr(GROUP // 2)
_E2M1_UNDO = tl.constexpr(E2M1_UNDO)


@dataclass(frozen=True, slots=True)
class Fp4Fp16Config:
    block_m: int   # sorted rows per program (one expert each)
    block_n: int   # output columns per program; the gate/up programs' also one lift step of the down's K
    block_k: int   # values of K a step (a multiple of GROUP dividing block_n): one lift step of the rows
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_k % GROUP or self.block_n % self.block_k:
            raise ValueError(f"Fp4Fp16Config: block_k must be a multiple of {GROUP} dividing block_n, got "
                             f"block_k={self.block_k}, block_n={self.block_n}")


@triton.jit
def _e8m0(byte):
    """Scale bytes [N, 1] (uint8) -> 2^(byte - 127) [N] float32 (byte 0, 2^-127, reads 0: no trained scale
    is that small; the loader refuses 0xFF)."""
    return tl.sum((byte.to(tl.int32) << 23).to(tl.float32, bitcast=True), axis=1)


@triton.jit
def _fp16_step(acc, acc2, x_rows, row_mask, s_xk, w_cols, s_cols, w2_cols, s2_cols, k0, k_dim, s_wk, s_sk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
               ASM: tl.constexpr):
    """One K step's products of one or (TWO) two FP4 weights sharing their activations, before the rows'
    lift is undone: (x[:, k0 : k0 + BLOCK_K] @ W^T[k0 : k0 + BLOCK_K] * 2^-6, the same with W2), each
    group's scale applied, added to acc and acc2. x_rows [BLOCK_M, 1]: lifted fp16 rows of row_mask;
    w_cols [1, BLOCK_N]: the packed rows of W's output columns (K / 2 bytes, strides s_wk); s_cols
    [BLOCK_N, 1]: their scale bytes (strides s_sk). Groups past K (a multiple of GROUP) add nothing."""
    for g in tl.static_range(BLOCK_K // _GROUP):
        kg = k0 + g * _GROUP
        even = kg + 2 * tl.arange(0, _HALF_GROUP)
        a_mask = row_mask[:, None] & (even < k_dim)[None, :]
        a_even = tl.load(x_rows + even[None, :] * s_xk, mask=a_mask, other=0.0)
        a_odd = tl.load(x_rows + (even + 1)[None, :] * s_xk, mask=a_mask, other=0.0)
        kp = kg // 2 + tl.arange(0, _HALF_GROUP)
        in_k = (kp < k_dim // 2)[:, None]
        s_mask = (kg + tl.zeros([1, 1], dtype=tl.int32)) < k_dim
        w = tl.load(w_cols + kp[:, None] * s_wk, mask=in_k, other=0)
        low, high = e2m1_to_fp16(w, ASM)
        product = tl.dot(a_odd, high, tl.dot(a_even, low))
        acc += product * _e8m0(tl.load(s_cols + (kg // _GROUP) * s_sk, mask=s_mask, other=0))[None, :]
        if TWO:
            w2 = tl.load(w2_cols + kp[:, None] * s_wk, mask=in_k, other=0)
            low2, high2 = e2m1_to_fp16(w2, ASM)
            product2 = tl.dot(a_odd, high2, tl.dot(a_even, low2))
            acc2 += product2 * _e8m0(tl.load(s2_cols + (kg // _GROUP) * s_sk, mask=s_mask, other=0))[None, :]
    return acc, acc2


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, xu_ptr, w13_ptr, ws_ptr, ids_ptr, sorted_ptr, block_expert_ptr, act_ptr, act_u_ptr,
    num_pairs, num_experts, hidden, inter, limit,
    s_xt, s_xd, s_xut, s_xuk, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_ar, s_ai, s_aur, s_auk, s_ids_t, s_ids_k,
    SCALE_N: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INLINE_ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
    GDC: tl.constexpr, ASM: tl.constexpr,
):
    if GDC:
        gdc_wait()
    expert, rows, row_mask, tokens, cols, col_mask, gate_rows, up_rows = gate_up_program(
        ids_ptr, sorted_ptr, block_expert_ptr, s_ids_t, s_ids_k, num_pairs, num_experts, inter,
        TOP_K, BLOCK_M, BLOCK_N, INLINE_ALIGN, BLOCK_E, BLOCK_P)
    if expert >= 0:
        x_rows = x_ptr + tokens[:, None] * s_xt
        w_expert = w13_ptr + expert.to(tl.int64) * s_we
        s_expert = ws_ptr + expert.to(tl.int64) * s_se
        gate_w, up_w = w_expert + gate_rows[None, :] * s_wn, w_expert + up_rows[None, :] * s_wn
        gate_s = s_expert + (gate_rows // SCALE_N)[:, None] * s_sn
        up_s = s_expert + (up_rows // SCALE_N)[:, None] * s_sn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            step_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            step_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            step_gate, step_up = _fp16_step(step_gate, step_up, x_rows, row_mask, s_xd, gate_w, gate_s, up_w, up_s,
                                            k0, hidden, s_wk, s_sk, BLOCK_M, BLOCK_N, BLOCK_K, True, ASM)
            unscale = tl.load(xu_ptr + tokens * s_xut + (k0 // BLOCK_K) * s_xuk) * _E2M1_UNDO
            acc_gate += step_gate * unscale[:, None]
            acc_up += step_up * unscale[:, None]
        if GDC:
            gdc_launch_dependents()
        act = swiglu_activation(acc_gate, acc_up, limit, tl.bfloat16, True)
        # Columns past I (read from row 0) are zeroed so that they do not set the lift.
        act16, act_unscale = lift_to_fp16(tl.where(col_mask[None, :], act, 0.0), 1)
        tl.store(act_ptr + rows[:, None].to(tl.int64) * s_ar + cols[None, :] * s_ai, act16,
                 mask=row_mask[:, None] & col_mask[None, :])
        tl.store(act_u_ptr + rows * s_aur + tl.program_id(1) * s_auk, act_unscale, mask=row_mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, act_u_ptr, w2_ptr, ws_ptr, sorted_ptr, block_expert_ptr, weights_ptr, pair_out_ptr,
    num_pairs, hidden, inter,
    s_ar, s_ai, s_aur, s_auk, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_tw_t, s_tw_k, s_pr,
    SCALE_N: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ACT_STEP: tl.constexpr, GDC: tl.constexpr, ASM: tl.constexpr,
):
    block = tl.program_id(0)
    if GDC:
        gdc_wait()
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows, pairs, row_mask, cols, col_mask, out_rows = down_rows(sorted_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
        a_rows = act_ptr + rows[:, None].to(tl.int64) * s_ar
        w_cols = w2_ptr + expert.to(tl.int64) * s_we + out_rows[None, :] * s_wn
        s_cols = ws_ptr + expert.to(tl.int64) * s_se + (out_rows // SCALE_N)[:, None] * s_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            step = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            # One product: the second accumulator and weight are bound to the first and never read.
            step, _ = _fp16_step(step, step, a_rows, row_mask, s_ai, w_cols, s_cols, w_cols, s_cols, k0, inter,
                                 s_wk, s_sk, BLOCK_M, BLOCK_N, BLOCK_K, False, ASM)
            # The activation was lifted ACT_STEP columns at a time (the gate/up programs' width).
            unscale = tl.load(act_u_ptr + rows * s_aur + (k0 // ACT_STEP) * s_auk, mask=row_mask, other=0.0)
            acc += step * (unscale * _E2M1_UNDO)[:, None]
        if GDC:
            gdc_launch_dependents()
        store_weighted_pairs(acc, weights_ptr, pair_out_ptr, pairs, row_mask, cols, col_mask, s_tw_t, s_tw_k, s_pr,
                             TOP_K)


def fp4_fp16_moe(x: torch.Tensor, w13: BlockFP4Weight, w2: BlockFP4Weight, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, limit: float, config: Fp4Fp16Config) -> torch.Tensor:
    """The fp16-tile path on inputs `fp4_experts.fp4_clamped_experts` checked: x [T, D] bf16, w13 [E, 2I, D]
    and w2 [E, D, I] FP4 with K blocks of 32, topk_weights [T, k] float32, topk_ids [T, k] (at least one
    pair) -> [T, D] bf16."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    num_pairs = topk_ids.numel()
    device = x.device
    c = config
    bm = c.block_m
    num_blocks, inline_align, sorted_pairs, block_expert = sorted_rows(topk_ids, num_experts, bm)
    num_rows = num_blocks * bm
    s13, s2 = w13.scale.view(torch.uint8), w2.scale.view(torch.uint8)
    use_pdl = pdl(device)
    asm = device.type == "cuda"
    x16, x_unscale = lifted_rows(x, c.block_k)
    act = torch.empty((num_rows, inter), dtype=torch.float16, device=device)
    act_unscale = torch.empty((num_rows, triton.cdiv(inter, c.block_n)), dtype=torch.float32, device=device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, c.block_n))](
        x16, x_unscale, w13.packed, s13, topk_ids, sorted_pairs, block_expert, act, act_unscale,
        num_pairs, num_experts, hidden, inter, float(limit),
        *x16.stride(), *x_unscale.stride(), *w13.packed.stride(), *s13.stride(), *act.stride(),
        *act_unscale.stride(), *topk_ids.stride(),
        SCALE_N=w13.block[0], TOP_K=topk_ids.shape[1], BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        # BLOCK_P only sizes the inline sort; elsewhere a fixed value, or every new
        # power of two of pairs in an eager step would compile another variant.
        INLINE_ALIGN=inline_align, BLOCK_E=max(2, next_pow2(num_experts)),
        BLOCK_P=max(2, next_pow2(num_pairs)) if inline_align else 2, GDC=use_pdl, ASM=asm,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    weights = topk_weights.float()
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, c.block_n))](
        act, act_unscale, w2.packed, s2, sorted_pairs, block_expert, weights, pair_out,
        num_pairs, hidden, inter,
        *act.stride(), *act_unscale.stride(), *w2.packed.stride(), *s2.stride(), *weights.stride(),
        pair_out.stride(0),
        SCALE_N=w2.block[0], TOP_K=topk_ids.shape[1], BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        ACT_STEP=c.block_n, GDC=use_pdl, ASM=asm,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=device)
    combine_pairs(pair_out, topk_ids, out)
    return out
