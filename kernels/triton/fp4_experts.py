"""DeepSeek-V4's routed experts read as stored: packed e2m1 weights and their e8m0 block scales in the kernel.

`reference.v4_moe.clamped_experts` on `BlockFP4Weight` experts computes with the dequantized
weights (`BlockFP4Weight.dequantize`: value * scale, exact in the activations' dtype). Here the
tiled fused MoE of `moe` (pairs sorted by expert, one expert per program's rows; gate/up with the
clamped SwiGLU, down scaled by the router weight, the k-way sum by `moe.combine_pairs`) reads the
packed bytes [BLOCK_K / 2, BLOCK_N] of each weight tile and its scale bytes [BLOCK_N, BLOCK_K / 32]
and hands both to `tl.dot_scaled`, which applies the scales to the unpacked values before the
tensor-core product (OCP MXFP4: one e8m0 scale per 32 values of a row, the first value of a byte
in its low nibble, as DeepSeek stores them). A weight value is read as half a byte plus 1/32 of a
scale byte, and the dense weight is never materialised.

The activations stay in bf16, the format `tl.dot_scaled` pairs with e2m1 (on GPUs without MX tensor
cores, Hopper's included, Triton widens the weight tile to bf16 in registers: value * scale, exact,
then a bf16 product with float32 accumulation, the reference's rounding). Other activation dtypes
and other K blocks take the dequantizing path (`QuantizedClampedExperts`).

On an H100 (V4-Flash's 256 experts of 4096 x 2048, top 6, `bench/kernels.py --fp4`) the first version,
scales broadcast over each tile with Triton's NaN check, read its bytes at 22.7% of the copy bandwidth
at one token and 32.7% at 16 (bench/results/kernels/h100/2026-11-27-2ee19b2.json): widening a tile
costs more than reading it. The check is now skipped
(`fast_math`: no scale byte is 0xFF), and `Fp4MoeConfig.scales_on_acc` applies each 32-value group's
scale to its product instead, as `fp8_linear` applies its block scales, for the sweep to weigh.

With a few rows an expert (decode) on Hopper, `Fp4MoeConfig.widened` takes the products the other way
round (`fp4_widened`): the weight tile, widened to fp16 through e4m3 with its scales in a few
instructions, as the MMA's left side in registers, against activation rows lifted to fp16 a row at a
time (`fp16_lift.lift_rows`, a pass before each product): the same products, summed in another order.
Where `gluon.fp4_experts.applies` (V4's shapes on Hopper), `Fp4MoeConfig.wgmma` runs those tiles as Gluon
kernels that load each packed word where the warpgroup MMA reads it (0.68-0.76x the Triton tiles' time on an
H200), from a few tokens to prefill sizes; the Triton tiles are their twin (the interpreter's path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..fp4_weight import BlockFP4Weight
from ..gluon import fp4_experts as wgmma_fp4
from ..hardware import e4m3_pairs_to_fp16, hopper
from ..quantized import Weight, dequantized
from ._common import next_pow2, pdl
from .fp16_lift import lift_rows
from .fp4_pairs import FP4_PAIR_MAX_PAIRS, fp4_pair_config, fp4_pair_moe
from .fp4_widened import widened_fp4_step
from .fp8_moe import down_rows, fp8_fused_moe, gate_up_program, sorted_rows, store_weighted_pairs
from .fp8_ops import fp8_pair
from .moe import combine_pairs
from .moe_align import moe_align
from .moe_pairs import PairConfig
from .swiglu import swiglu_activation

# Values one e8m0 scale covers along K: the only group `tl.dot_scaled` takes.
MX_GROUP = 32


@dataclass(frozen=True, slots=True)
class Fp4MoeConfig:
    block_m: int   # sorted rows per program (one expert each)
    block_n: int   # output columns per program
    block_k: int   # values of K a step (a multiple of MX_GROUP)
    num_warps: int
    num_stages: int
    # Where the scales apply: False, to the weight tile inside `tl.dot_scaled` (Triton broadcasts them over
    # the tile); True, to each group's product in the accumulator, one `tl.dot_scaled` of unscaled values
    # per MX_GROUP of K (as `fp8_linear` applies its block scales). The same sums in another order.
    scales_on_acc: bool = False
    # The weight tiles widened to fp16 in registers as the product's left side (`fp4_widened`: the tile's
    # rows as the MMA's M, the sorted rows as its N) instead of `tl.dot_scaled`'s. Hopper only (the e4m3
    # pair conversion, `hardware.e4m3_pairs_to_fp16`; Triton's operations elsewhere, slowly).
    widened: bool = False
    # With `widened`: the Gluon kernels on Hopper's warpgroup MMA (`gluon.fp4_experts`, each packed word loaded
    # where the MMA reads it) wherever `gluon.fp4_experts.applies`, else these tiles in Triton (their twin).
    wgmma: bool = False


# Decode: a row or two per expert, so the GEMMs stream the chosen experts' bytes; 64-wide column
# tiles give every multiprocessor programs. 32 rows and 128-deep K steps are inside the shapes
# Triton's own tests run `dot_scaled` at on Hopper (M, N in 32..128, K 64 or 128). Prefill: 64-row tiles.
_GPU_DECODE = Fp4MoeConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)
_GPU_PREFILL = Fp4MoeConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
_INTERPRETER = Fp4MoeConfig(block_m=16, block_n=32, block_k=MX_GROUP, num_warps=4, num_stages=1)
# A few rows an expert on Hopper: the widened tiles, 16 rows (the MMA's N) a program, in Triton.
# On an H200 (V4-Flash's experts, bench/notes/fp8.md) they took 0.78-0.81x `dot_scaled`'s decode tiles' time
# at 1.5-6 rows an expert, 0.85-0.87x at 9, 0.94-1.00x at 12 and 1.4x at 18; against the per-pair path 1.06x
# at 96 pairs, 0.93x at 144 and 0.84x at 192. Pairs count with their dropped slots (an expert-parallel rank
# sees the other ranks' experts as -1): at DP 2 + EP, 6 rows an expert are 12 pairs an expert held.
_GPU_WIDENED = Fp4MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2, widened=True)
_WIDENED_MAX_PAIRS_PER_EXPERT = 12
_WIDENED_PAIR_MAX_PAIRS = 120
# The same tiles on the warpgroup MMA (`gluon.fp4_experts`), where they apply. On an H200 (bench/notes/fp8.md)
# against the per-pair path: 0.98-1.01x at 18-24 pairs, 0.96x at 36, 0.89-0.91x at 48, 0.76x at 96; against
# `dot_scaled`'s decode tiles 0.56-0.63x at 0.5-12 rows an expert, 0.76-0.77x at 18, 0.84-0.88x at 24; against
# its 64-row tiles 0.85-0.96x at 48 rows an expert, 0.66-0.85x at 72-128, 0.89x at 192 (further not measured).
_GPU_WARPGROUP = dataclasses.replace(_GPU_WIDENED, wgmma=True)
_WARPGROUP_MAX_PAIRS_PER_EXPERT = 192
_WARPGROUP_PAIR_MAX_PAIRS = 24


def fp4_moe_config(num_pairs: int, num_experts: int, device: torch.device, *, warpgroup: bool = False
                   ) -> Fp4MoeConfig | PairConfig:
    """The launch configuration, and so the path, for num_pairs = T * k pairs over num_experts experts: up to
    FP4_PAIR_MAX_PAIRS pairs the per-pair path on CUDA cores (`fp4_pairs`, one launch), else the tiled one.
    On Hopper, where they were measured (`hardware.hopper`: no FP4 tensor cores, e4m3 pairs converted in one
    instruction), the widened tiles take over from the per-pair path past _WIDENED_PAIR_MAX_PAIRS pairs and run
    up to _WIDENED_MAX_PAIRS_PER_EXPERT pairs an expert; past that, `tl.dot_scaled`'s tiles. With `warpgroup`
    (the Gluon kernels take these experts: `gluon.fp4_experts.applies`) the widened tiles on the warpgroup MMA,
    past _WARPGROUP_PAIR_MAX_PAIRS pairs and up to _WARPGROUP_MAX_PAIRS_PER_EXPERT pairs an expert."""
    widened = hopper(device)
    pair_max, tiles, per_expert = (
        (_WARPGROUP_PAIR_MAX_PAIRS, _GPU_WARPGROUP, _WARPGROUP_MAX_PAIRS_PER_EXPERT) if warpgroup
        else (_WIDENED_PAIR_MAX_PAIRS, _GPU_WIDENED, _WIDENED_MAX_PAIRS_PER_EXPERT))
    if num_pairs <= (min(FP4_PAIR_MAX_PAIRS, pair_max) if widened else FP4_PAIR_MAX_PAIRS):
        return fp4_pair_config(num_pairs, device)
    if device.type != "cuda":
        return _INTERPRETER
    if widened and num_pairs <= per_expert * num_experts:
        return tiles
    # Up to a decode tile of rows an expert (32) the decode tiles: at 24 rows an expert they took 0.64-0.67x
    # the 64-row tiles' time on an H200, at 48 rows 1.12-1.13x, past that within 3% (bench/notes/fp8.md).
    return _GPU_DECODE if num_pairs <= _GPU_DECODE.block_m * num_experts else _GPU_PREFILL


@triton.jit
def _scaled_fp4(a, w, byte, acc, SCALES_ON_ACC: tl.constexpr):
    """acc + a [M, K] (bf16) @ the e2m1 tile w [K / 2, N] (packed along K) under its scale bytes: [N, K / 32]
    applied to the tile by `tl.dot_scaled`, or, SCALES_ON_ACC (K = 32), [N, 1] applied to the product."""
    if SCALES_ON_ACC:
        # 2^(byte - 127) as its float32 bits (byte 0, 2^-127, would read 0: no trained scale is that small).
        scale = tl.sum((byte.to(tl.int32) << 23).to(tl.float32, bitcast=True), axis=1)
        return acc + tl.dot_scaled(a, None, "bf16", w, None, "e2m1") * scale[None, :]
    # The loader refuses non-finite scales, so no byte is 0xFF (NaN): `fast_math` skips that check.
    return tl.dot_scaled(a, None, "bf16", w, byte, "e2m1", acc=acc, fast_math=True)


@triton.jit
def _fp4_step(acc, acc2, x_rows, row_mask, s_xk, w_cols, s_cols, w2_cols, s2_cols, k0, k_dim, s_wk, s_sk,
              BLOCK_K: tl.constexpr, TWO: tl.constexpr, SCALES_ON_ACC: tl.constexpr):
    """One K step of one or (TWO) two FP4 products that share their activations: acc [BLOCK_M, BLOCK_N] +
    x[:, k0 : k0 + BLOCK_K] @ W^T[k0 : k0 + BLOCK_K], and acc2 likewise with W2. x_rows [BLOCK_M, 1]: the
    activation rows (bf16) of row_mask [BLOCK_M]; w_cols [1, BLOCK_N]: the packed rows of W's output columns
    (K / 2 bytes, strides s_wk); s_cols [BLOCK_N, 1]: their scale bytes (strides s_sk). Past K: zero bytes
    (e2m1 zeros) under a unit scale (127). With SCALES_ON_ACC, one product per group of 32 values of K."""
    GROUP: tl.constexpr = 32 if SCALES_ON_ACC else BLOCK_K
    for g in tl.static_range(BLOCK_K // GROUP):
        kg = k0 + g * GROUP
        ks = kg + tl.arange(0, GROUP)
        a = tl.load(x_rows + ks[None, :] * s_xk, mask=row_mask[:, None] & (ks[None, :] < k_dim), other=0.0)
        kp = kg // 2 + tl.arange(0, GROUP // 2)
        p_mask = (kp < k_dim // 2)[:, None]
        if SCALES_ON_ACC:
            s_offs = (kg // 32) * s_sk                                  # one scale a column: [BLOCK_N, 1]
            s_mask = (kg + tl.zeros([1, 1], dtype=tl.int32)) < k_dim
        else:
            kb = kg // 32 + tl.arange(0, GROUP // 32)
            s_offs = kb[None, :] * s_sk                                 # [BLOCK_N, GROUP / 32]
            s_mask = (kb < k_dim // 32)[None, :]
        w = tl.load(w_cols + kp[:, None] * s_wk, mask=p_mask, other=0)
        acc = _scaled_fp4(a, w, tl.load(s_cols + s_offs, mask=s_mask, other=127), acc, SCALES_ON_ACC)
        if TWO:
            w2 = tl.load(w2_cols + kp[:, None] * s_wk, mask=p_mask, other=0)
            acc2 = _scaled_fp4(a, w2, tl.load(s2_cols + s_offs, mask=s_mask, other=127), acc2, SCALES_ON_ACC)
    return acc, acc2


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, unlift_ptr, w13_ptr, ws_ptr, ids_ptr, sorted_ptr, block_expert_ptr, act_ptr,
    num_pairs, num_experts, hidden, inter, limit,
    s_xt, s_xd, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_ar, s_ai, s_ids_t, s_ids_k,
    SCALE_N: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INLINE_ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
    GDC: tl.constexpr, SCALES_ON_ACC: tl.constexpr, WIDENED: tl.constexpr, ASM: tl.constexpr,
):
    if GDC:
        gdc_wait()
    expert, rows, row_mask, tokens, cols, col_mask, gate_rows, up_rows = gate_up_program(
        ids_ptr, sorted_ptr, block_expert_ptr, s_ids_t, s_ids_k, num_pairs, num_experts, inter,
        TOP_K, BLOCK_M, BLOCK_N, INLINE_ALIGN, BLOCK_E, BLOCK_P)
    if expert >= 0:
        x_rows = x_ptr + tokens * s_xt
        w_expert = w13_ptr + expert.to(tl.int64) * s_we
        s_expert = ws_ptr + expert.to(tl.int64) * s_se
        gate_w, up_w = w_expert + gate_rows * s_wn, w_expert + up_rows * s_wn
        gate_s, up_s = s_expert + (gate_rows // SCALE_N) * s_sn, s_expert + (up_rows // SCALE_N) * s_sn
        if WIDENED:   # x lifted to fp16 (`lift_rows`); the products transposed: [BLOCK_N, BLOCK_M]
            unlift = tl.load(unlift_ptr + tokens, mask=row_mask, other=1.0)
            acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                acc_gate, acc_up = widened_fp4_step(acc_gate, acc_up, x_rows, row_mask, s_xd, unlift, gate_w, gate_s,
                                                    up_w, up_s, k0, hidden, s_sk, BLOCK_K, True, ASM)
            if GDC:
                gdc_launch_dependents()
            act = swiglu_activation(acc_gate, acc_up, limit, tl.bfloat16, True)
            tl.store(act_ptr + rows[None, :].to(tl.int64) * s_ar + cols[:, None] * s_ai, act,
                     mask=row_mask[None, :] & col_mask[:, None])
        else:
            acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                acc_gate, acc_up = _fp4_step(acc_gate, acc_up, x_rows[:, None], row_mask, s_xd, gate_w[None, :],
                                             gate_s[:, None], up_w[None, :], up_s[:, None], k0, hidden, s_wk, s_sk,
                                             BLOCK_K, True, SCALES_ON_ACC)
            if GDC:
                gdc_launch_dependents()
            act = swiglu_activation(acc_gate, acc_up, limit, tl.bfloat16, True)
            tl.store(act_ptr + rows[:, None].to(tl.int64) * s_ar + cols[None, :] * s_ai, act,
                     mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, unlift_ptr, w2_ptr, ws_ptr, sorted_ptr, block_expert_ptr, weights_ptr, pair_out_ptr,
    num_pairs, hidden, inter,
    s_ar, s_ai, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_tw_t, s_tw_k, s_pr,
    SCALE_N: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GDC: tl.constexpr, SCALES_ON_ACC: tl.constexpr, WIDENED: tl.constexpr,
    ASM: tl.constexpr,
):
    block = tl.program_id(0)
    if GDC:
        gdc_wait()
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows, pairs, row_mask, cols, col_mask, out_rows = down_rows(sorted_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
        a_rows = act_ptr + rows.to(tl.int64) * s_ar
        w_cols = w2_ptr + expert.to(tl.int64) * s_we + out_rows * s_wn
        s_cols = ws_ptr + expert.to(tl.int64) * s_se + (out_rows // SCALE_N) * s_sn
        # One product: the second accumulator and weight are bound to the first and never read.
        if WIDENED:   # act lifted to fp16 (`lift_rows`); the product transposed
            unlift = tl.load(unlift_ptr + rows, mask=row_mask, other=1.0)
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                acc_t, _ = widened_fp4_step(acc_t, acc_t, a_rows, row_mask, s_ai, unlift, w_cols, s_cols, w_cols,
                                            s_cols, k0, inter, s_sk, BLOCK_K, False, ASM)
            acc = tl.trans(acc_t)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                acc, _ = _fp4_step(acc, acc, a_rows[:, None], row_mask, s_ai, w_cols[None, :], s_cols[:, None],
                                   w_cols[None, :], s_cols[:, None], k0, inter, s_wk, s_sk, BLOCK_K, False, SCALES_ON_ACC)
        if GDC:
            gdc_launch_dependents()
        store_weighted_pairs(acc, weights_ptr, pair_out_ptr, pairs, row_mask, cols, col_mask, s_tw_t, s_tw_k, s_pr,
                             TOP_K)


def fp4_pair(x: torch.Tensor, w: Weight) -> BlockFP4Weight | None:
    """`w` when `fp4_clamped_experts` reads it as it is (a stacked FP4 pair whose K blocks are the MX group,
    against bf16 activations), else None."""
    if isinstance(w, BlockFP4Weight) and w.block[1] == MX_GROUP and w.packed.ndim == 3 and x.dtype == torch.bfloat16:
        return w
    return None


def fp4_clamped_experts(x: torch.Tensor, w13: BlockFP4Weight, w2: BlockFP4Weight, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, limit: float, config: Fp4MoeConfig | PairConfig | None = None
                        ) -> torch.Tensor:
    """Contract of `reference.v4_moe.clamped_experts` with FP4 experts read packed.

    x:            [T, D] bf16 (any strides)
    w13:          [E, 2I, D] as packed [E, 2I, D / 2] uint8 and scale [E, 2I / bn, D / 32] float8_e8m0fnu
                  (gate rows, then up)
    w2:           [E, D, I] as packed [E, D, I / 2] and scale [E, D / bn, I / 32]
    topk_weights: [T, k] any float dtype (used in float32); topk_ids [T, k] int32 / int64 in [-1, E)
                  (-1: no expert; ids >= E are not checked, which would need a host sync)
    limit:        the SwiGLU clamp (`swiglu_limit`)
    returns       [T, D] bf16. Pre-activations and the activation rounded to bf16, products and the
                  k-way sum in float32. `config` overrides `fp4_moe_config` (a `PairConfig` takes the
                  per-pair path, whose float32 atomics add the k terms in an order, and so to last bits,
                  that may differ from run to run).
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    check_dtype("x", x, (torch.bfloat16,))
    check_shape("w13", w13, (num_experts, 2 * inter, hidden))
    check_shape("w2", w2, (num_experts, hidden, inter))
    for name, w in (("w13", w13), ("w2", w2)):
        if w.block[1] != MX_GROUP:
            raise ValueError(f"{name}: FP4 blocks of {w.block[1]} values along K; the kernel reads groups of "
                             f"{MX_GROUP} (dequantize it instead)")
    check_shape("topk_ids", topk_ids, (num_tokens, None))
    top_k = topk_ids.shape[1]
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_same_device(x=x, w13=w13.packed, w13_scale=w13.scale, w2=w2.packed, w2_scale=w2.scale,
                      topk_weights=topk_weights, topk_ids=topk_ids)
    device = x.device
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=device)
    warpgroup = wgmma_fp4.applies(x, w13, w2)
    c = config or fp4_moe_config(num_pairs, num_experts, device, warpgroup=warpgroup)
    if isinstance(c, PairConfig):
        pair_sum = fp4_pair_moe(x, w13, w2, topk_weights.float(), topk_ids, limit=limit, config=c)
        return pair_sum.to(x.dtype)
    if c.block_k % MX_GROUP:
        raise ValueError(f"config.block_k: expected a multiple of {MX_GROUP}, got {c.block_k}")
    if c.widened and c.scales_on_acc:
        raise ValueError("config: widened tiles apply their scales to the tiles; scales_on_acc must be False")
    if c.wgmma and not (c.widened and c.block_m == wgmma_fp4.BLOCK_M):
        raise ValueError(f"config: the warpgroup-MMA tiles are widened tiles of {wgmma_fp4.BLOCK_M} rows; got "
                         f"widened={c.widened}, block_m={c.block_m}")
    if c.wgmma and warpgroup:
        return _wgmma_clamped_experts(x, w13, w2, topk_weights.float(), topk_ids, limit)
    if c.widened and (w13.packed.stride(-1) != 1 or w2.packed.stride(-1) != 1):
        raise ValueError(f"widened tiles read packed rows of unit stride along K; got strides "
                         f"{w13.packed.stride()} (w13) and {w2.packed.stride()} (w2)")
    asm = e4m3_pairs_to_fp16(device)
    bm = c.block_m
    num_blocks, inline_align, sorted_pairs, block_expert = sorted_rows(topk_ids, num_experts, bm)
    num_rows = num_blocks * bm
    # e8m0 bytes as uint8: what `dot_scaled` takes for its scales.
    s13, s2 = w13.scale.view(torch.uint8), w2.scale.view(torch.uint8)
    use_pdl = pdl(device)
    act = torch.empty((num_rows, inter), dtype=x.dtype, device=device)
    # Widened tiles meet the activations as fp16 rows, lifted a row at a time; else x and no lift (unread).
    x_in, x_unlift = lift_rows(x) if c.widened else (x, x)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, c.block_n))](
        x_in, x_unlift, w13.packed, s13, topk_ids, sorted_pairs, block_expert, act,
        num_pairs, num_experts, hidden, inter, float(limit),
        *x_in.stride(), *w13.packed.stride(), *s13.stride(), *act.stride(), *topk_ids.stride(),
        SCALE_N=w13.block[0], TOP_K=top_k, BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        # BLOCK_P only sizes the inline sort; elsewhere a fixed value, or every new
        # power of two of pairs in an eager step would compile another variant.
        INLINE_ALIGN=inline_align, BLOCK_E=max(2, next_pow2(num_experts)),
        BLOCK_P=max(2, next_pow2(num_pairs)) if inline_align else 2, GDC=use_pdl, SCALES_ON_ACC=c.scales_on_acc,
        WIDENED=c.widened, ASM=asm, num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    weights = topk_weights.float()
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=device)
    act_in, act_unlift = lift_rows(act) if c.widened else (act, act)
    _down_kernel[(num_blocks, triton.cdiv(hidden, c.block_n))](
        act_in, act_unlift, w2.packed, s2, sorted_pairs, block_expert, weights, pair_out,
        num_pairs, hidden, inter,
        *act_in.stride(), *w2.packed.stride(), *s2.stride(), *weights.stride(), pair_out.stride(0),
        SCALE_N=w2.block[0], TOP_K=top_k, BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GDC=use_pdl,
        SCALES_ON_ACC=c.scales_on_acc, WIDENED=c.widened, ASM=asm, num_warps=c.num_warps, num_stages=c.num_stages,
        launch_pdl=use_pdl,
    )
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=device)
    combine_pairs(pair_out, topk_ids, out)
    return out


def _wgmma_clamped_experts(x: torch.Tensor, w13: BlockFP4Weight, w2: BlockFP4Weight, weights: torch.Tensor,
                           topk_ids: torch.Tensor, limit: float) -> torch.Tensor:
    """`fp4_clamped_experts` on the Gluon kernels (`gluon.fp4_experts`): x [T, D] bf16, weights [T, k] float32
    -> [T, D] bf16. Both products' activations lifted to fp16 in the kernels' K order (`K_ORDER_BITS`)."""
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    sorted_pairs, block_expert = moe_align(topk_ids, w13.shape[0], wgmma_fp4.BLOCK_M)
    x16, x_unlift = lift_rows(x, wgmma_fp4.K_ORDER_BITS)
    act = torch.empty((sorted_pairs.numel(), inter), dtype=torch.bfloat16, device=x.device)
    wgmma_fp4.wgmma_fp4_gate_up(x16, x_unlift, w13, sorted_pairs, block_expert, topk_ids.shape[1], limit, act)
    act16, act_unlift = lift_rows(act, wgmma_fp4.K_ORDER_BITS)
    pair_out = torch.empty((topk_ids.numel(), hidden), dtype=torch.float32, device=x.device)
    wgmma_fp4.wgmma_fp4_down(act16, act_unlift, w2, sorted_pairs, block_expert, weights, pair_out)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    combine_pairs(pair_out, topk_ids, out)
    return out


@dataclass(frozen=True, slots=True)
class QuantizedClampedExperts:
    """`contracts.ClampedExperts` for the Triton table: FP4 experts to `fp4_clamped_experts` (bf16 activations,
    K blocks of 32), FP8 experts to `fp8_moe.fp8_fused_moe` with the clamp, anything else dequantized into
    `dense(x, w13, w2, topk_weights, topk_ids, *, limit)`, the 16-bit kernel."""

    dense: Callable[..., torch.Tensor]

    def __call__(self, x: torch.Tensor, w13: Weight, w2: Weight, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, /, *, limit: float) -> torch.Tensor:
        """x [T, D] -> [T, D] in x's dtype (see `contracts.ClampedExperts`)."""
        fp4_up, fp4_down = fp4_pair(x, w13), fp4_pair(x, w2)
        if fp4_up is not None and fp4_down is not None:
            return fp4_clamped_experts(x, fp4_up, fp4_down, topk_weights, topk_ids, limit=limit)
        up, down = fp8_pair(w13), fp8_pair(w2)
        if up is not None and down is not None and up.block == down.block:
            return fp8_fused_moe(x, up.values, up.scale_inv, down.values, down.scale_inv, topk_weights.float(),
                                 topk_ids, block=up.block, limit=limit)
        return self.dense(x, dequantized(w13, x.dtype), dequantized(w2, x.dtype), topk_weights, topk_ids, limit=limit)

