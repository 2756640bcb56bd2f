"""The per-pair path of DeepSeek-V4's routed experts held as FP4: one launch for decode's few pairs.

`fp8_moe_pairs`' scheme over `BlockFP4Weight` experts (packed e2m1, two values a byte along K, the even
column in the low nibble; one e8m0 scale per 32 values of a row): a program takes one (token, slot) pair
and BLOCK_I of its expert's intermediate columns, computes their gate/up products and the clamped
SwiGLU, and adds its slice's share of the down projection into the token's zeroed float32 row with
atomics. A pair is one row, so the products run on CUDA cores: each word of packed bytes is widened
through e4m3 (`e2m1_widen`: a few bit operations for four bytes, one conversion for two values, the
value times 2^-6), then to float32, multiplied by the row's even and odd columns, summed a group of 32
values at a time, and each group's sum times its scale (2^(byte - 127)) and 2^6. The reference's math
(`BlockFP4Weight.dequantize`: value * scale, exact) summed in another order.

The tiled path (`fp4_experts`: `tl.dot_scaled`, which on Hopper widens each e2m1 tile to bf16 in
registers before a tensor-core product of one live row in 32) reads V4-Flash's experts at a fifth of
the copy bandwidth at one token. Here, on an H200, 0.49x its time at one token, 0.53-0.55x at 2-8 tokens,
0.71-0.73x at 16 and 0.89x at 32 (bench/notes/fp8.md); the widening through e4m3 took 0.78-0.89x the time
of the one before it (each nibble's bits placed in an fp16 alone), and the settings after it a little less.
The float32 atomics make the order of the k-way sum, and so its last bits, vary from run to run, as in the
other per-pair paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp4_weight import BlockFP4Weight
from ._common import next_pow2, pdl
from ..hardware import e4m3_pairs_to_fp16
from .e2m1_widen import E2M1_UNDO, e2m1_to_fp16
from .fill import zeros
from .fp8_moe_pairs import pair_program
from .moe_pairs import PairConfig
from .swiglu import swiglu_activation

# Values one e8m0 scale covers along K (the only K block the kernel reads); as a constexpr for the kernel.
GROUP = 32
_GROUP = tl.constexpr(GROUP)
_E2M1_UNDO = tl.constexpr(E2M1_UNDO)
# With the e4m3 widening, on an H200 (V4-Flash's experts, one process, two rounds; bench/notes/fp8.md): one
# token's 6 pairs ran best with 32 intermediate columns a program, 512-deep K steps, 256-deep output steps and
# 4 warps (50.3-50.8 us against 60.9-61.8 with 256-deep K steps), and from 12 pairs on with 64 columns and
# 256-deep K steps (84.4 against 115.3 us at 12 pairs, 318 against 350 at 48, 670 against 897 at 96).
_GPU_FP4_FEW_PAIRS = PairConfig(block_i=32, block_k=512, block_d=256, num_warps=4, num_stages=1)
_GPU_FP4_PAIRS = PairConfig(block_i=64, block_k=256, block_d=256, num_warps=4, num_stages=1)
_FEW_PAIRS = 8
_INTERPRETER_FP4_PAIRS = PairConfig(block_i=16, block_k=64, block_d=32, num_warps=4, num_stages=1)
# Up to this many pairs the per-pair path runs: it reads an expert's bytes once per pair, the tiled path
# once per expert chosen. On an H200 (V4-Flash's 256 experts, top 6, the settings above, one process, two
# rounds) it took 0.71-0.73x the tiled path's time at 96 pairs, 0.80-0.81x at 144, 0.89x at 192 and 1.04x
# at 288.
FP4_PAIR_MAX_PAIRS = 192


def fp4_pair_config(num_pairs: int, device: torch.device) -> PairConfig:
    """The FP4 per-pair path's launch configuration for num_pairs pairs on `device`."""
    if device.type != "cuda":
        return _INTERPRETER_FP4_PAIRS
    return _GPU_FP4_FEW_PAIRS if num_pairs <= _FEW_PAIRS else _GPU_FP4_PAIRS


@triton.jit
def _group_scales(scale_bytes):
    """e8m0 scale bytes [...] (uint8) -> 2^(byte - 127) * 2^6 as float32 (byte 0 reads 0: no trained scale
    is 2^-127); the 2^6 undoes the widening's 2^-6 (`e2m1_widen`)."""
    return (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True) * _E2M1_UNDO


@triton.jit
def _pair_products(packed, even, odd, ASM: tl.constexpr):
    """A packed tile [R, B] (two e2m1 values a byte, the even column low) times the row's even and odd
    columns [B] (float32): each byte's two products summed, times 2^-6 -> [R, B]."""
    low, high = e2m1_to_fp16(packed, ASM)
    return low.to(tl.float32) * even[None, :] + high.to(tl.float32) * odd[None, :]


@triton.jit
def _row_step(packed, x_even, x_odd, scales, ROWS: tl.constexpr, BYTES: tl.constexpr, ASM: tl.constexpr):
    """sum over K of w * x for a packed tile [ROWS, BYTES] (two values a byte) against the row's even and odd
    columns [BYTES] (float32), each group of 32 values times its scale [ROWS, BYTES // 16] -> [ROWS]."""
    prod = _pair_products(packed, x_even, x_odd, ASM)
    groups = tl.sum(tl.reshape(prod, [ROWS, BYTES // 16, 16]), axis=2)
    return tl.sum(groups * _group_scales(scales), axis=1)


@triton.jit
def _fp4_pair_kernel(
    x_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, inter, limit,
    s_xt, s_xd, s_ge, s_gn, s_gk, s_gse, s_gsn, s_gsk, s_de, s_dd, s_di, s_dse, s_dsn, s_dsk,
    s_ids_t, s_ids_k, s_tw_t, s_tw_k, s_ot,
    SCALE_N13: tl.constexpr, SCALE_N2: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr, ASM: tl.constexpr,
):
    """One (token, slot) pair, BLOCK_I of its expert's intermediate columns: gate/up, clamped SwiGLU, down.
    BLOCK_K (a multiple of 32) values of the hidden dimension a gate/up step; BLOCK_I columns lie in whole
    scale groups of w2 (a multiple of 32) or inside one (a divisor of 32)."""
    token, expert, router, offs_i, i_mask, gate_rows, up_rows = pair_program(
        ids_ptr, weights_ptr, inter, s_ids_t, s_ids_k, s_tw_t, s_tw_k, TOP_K, BLOCK_I, GDC)
    if expert >= 0:
        # Out-of-range columns read row 0 (their activation is zeroed below): no mask on the weight rows.
        w_gate = w13_ptr + expert * s_ge + gate_rows[:, None].to(tl.int64) * s_gn
        w_up = w13_ptr + expert * s_ge + up_rows[:, None].to(tl.int64) * s_gn
        s_gate = s13_ptr + expert * s_gse + (gate_rows // SCALE_N13)[:, None] * s_gsn
        s_up = s13_ptr + expert * s_gse + (up_rows // SCALE_N13)[:, None] * s_gsn
        x_row = x_ptr + token * s_xt
        BYTES: tl.constexpr = BLOCK_K // 2
        offs_b = tl.arange(0, BYTES)
        offs_g = tl.arange(0, BLOCK_K // _GROUP)
        acc_gate = tl.zeros([BLOCK_I], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_I], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            bs = k0 // 2 + offs_b
            b_mask = bs < hidden // 2
            x_even = tl.load(x_row + (2 * bs) * s_xd, mask=b_mask, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + (2 * bs + 1) * s_xd, mask=b_mask, other=0.0).to(tl.float32)
            gs = k0 // _GROUP + offs_g
            g_mask = (gs < hidden // _GROUP)[None, :]
            gate = tl.load(w_gate + bs[None, :] * s_gk, mask=b_mask[None, :], other=0)
            up = tl.load(w_up + bs[None, :] * s_gk, mask=b_mask[None, :], other=0)
            acc_gate += _row_step(gate, x_even, x_odd, tl.load(s_gate + gs[None, :] * s_gsk, mask=g_mask, other=0),
                                  BLOCK_I, BYTES, ASM)
            acc_up += _row_step(up, x_even, x_odd, tl.load(s_up + gs[None, :] * s_gsk, mask=g_mask, other=0),
                                BLOCK_I, BYTES, ASM)
        act = swiglu_activation(acc_gate, acc_up, limit, tl.bfloat16, True)
        act = tl.where(i_mask, act.to(tl.float32), 0.0)
        # The down product over this program's columns: their bytes, and the activation's even and odd ones.
        HALF_I: tl.constexpr = BLOCK_I // 2
        offs_h = tl.arange(0, HALF_I)
        pair_cols = tl.program_id(1) * HALF_I + offs_h
        h_mask = pair_cols < inter // 2
        act_pairs = tl.reshape(act, [HALF_I, 2])
        act_even, act_odd = tl.split(act_pairs)
        offs_d = tl.arange(0, BLOCK_D)
        out_row = out_ptr + token * s_ot
        w_down = w2_ptr + expert * s_de + pair_cols[None, :] * s_di
        # The scale groups of w2 the columns lie in: BLOCK_I // 32 whole ones, or the one holding them all.
        GROUPS: tl.constexpr = (BLOCK_I + _GROUP - 1) // _GROUP
        group_cols = (tl.program_id(1) * BLOCK_I) // _GROUP + tl.arange(0, GROUPS)
        for d0 in range(0, hidden, BLOCK_D):
            ds = d0 + offs_d
            d_mask = ds < hidden
            w = tl.load(w_down + ds[:, None].to(tl.int64) * s_dd, mask=d_mask[:, None] & h_mask[None, :], other=0)
            s_rows = s2_ptr + expert * s_dse + (ds // SCALE_N2)[:, None] * s_dsn
            # Groups past I (the last program's columns partly past it) read scale 0 over zero bytes.
            scales = tl.load(s_rows + group_cols[None, :] * s_dsk,
                             mask=d_mask[:, None] & (group_cols < inter // _GROUP)[None, :], other=0)
            if BLOCK_I >= _GROUP:
                part = _row_step(w, act_even, act_odd, scales, BLOCK_D, HALF_I, ASM)
            else:
                part = tl.sum(_pair_products(w, act_even, act_odd, ASM), axis=1) * tl.sum(_group_scales(scales), axis=1)
            tl.atomic_add(out_row + ds, part * router, mask=d_mask, sem="relaxed")


def fp4_pair_moe(x: torch.Tensor, w13: BlockFP4Weight, w2: BlockFP4Weight, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, limit: float, config: PairConfig) -> torch.Tensor:
    """The per-pair path on inputs `fp4_experts.fp4_clamped_experts` checked: x [T, D] bf16, w13 [E, 2I, D]
    and w2 [E, D, I] FP4 with K blocks of 32, topk_weights / topk_ids [T, k] -> a float32 [T, D] (a zeroed
    row summed into)."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    block_i = min(config.block_i, max(2, next_pow2(inter)))
    if block_i % GROUP and GROUP % block_i:
        raise ValueError(f"config.block_i: expected a multiple or a divisor of {GROUP}, got {config.block_i}")
    if config.block_k % GROUP:
        raise ValueError(f"config.block_k: expected a multiple of {GROUP}, got {config.block_k}")
    out = zeros((num_tokens, hidden), torch.float32, x.device)
    s13, s2 = w13.scale.view(torch.uint8), w2.scale.view(torch.uint8)
    use_pdl = pdl(x.device)
    _fp4_pair_kernel[(topk_ids.numel(), triton.cdiv(inter, block_i))](
        x, w13.packed, s13, w2.packed, s2, topk_ids, topk_weights, out,
        hidden, inter, float(limit),
        *x.stride(), *w13.packed.stride(), *s13.stride(), *w2.packed.stride(), *s2.stride(),
        *topk_ids.stride(), *topk_weights.stride(), out.stride(0),
        SCALE_N13=w13.block[0], SCALE_N2=w2.block[0], TOP_K=topk_ids.shape[1], BLOCK_I=block_i,
        BLOCK_K=config.block_k, BLOCK_D=min(config.block_d, max(16, next_pow2(hidden))), GDC=use_pdl,
        ASM=e4m3_pairs_to_fp16(x.device),
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    return out
