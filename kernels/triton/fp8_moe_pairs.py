"""The per-pair path of the fused MoE over block-scaled FP8 experts: one launch for decode's few pairs.

`moe_pairs`' scheme with FP8 weight tiles: a program takes one (token, slot) pair and BLOCK_I of its
expert's intermediate columns, computes their gate/up products and activation, and adds its slice's
share of the down projection into the token's zeroed float32 row with atomics. A pair is one row, so
the products run on CUDA cores as `fp8_linear`'s one-row product does: each FP8 tile widened to
float32, multiplied by the row (or the activation) and summed in registers, each run of columns
inside one scale block taking its block's scale (`fp8_linear`'s math): per gate/up column for w13,
per output column for w2, whose K (intermediate) block a program's columns lie inside (BLOCK_I, a
power of two, at most the scale block's K). No 16-row tensor-core tile holds one live row.

Against the tiled path (`fp8_moe`: gate/up, down and combine launches over 16-row tiles, one row
of which is live at decode) it saves two launches and the idle tiles; the float32 atomics make the
order of the k-way sum, and so its last bits, vary from run to run, as in the bf16 per-pair path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import TL_DTYPES, h200, next_pow2, pdl
from .fill import zeros
from .fp8_linear import scaled_row_step
from .moe_pairs import PairConfig
from .swiglu import swiglu_activation

# Chosen on an H100 from 48 settings, graph replays of the whole op at one token over 8 routings
# (bench/results/kernels/h100/logs-archive/fp8-moe-row-sweep-h100-2026-11-28.log): 32 experts of V3's
# shapes (D 7168, I 2048, top-8) 134.6 us against 149.9 for the tensor-core pair kernel in the same
# run, 64 of v2-lite's (D 2048, I 1408, top-6) 29.9 against 31.8; 32 intermediate columns a program or
# 4 warps 145-155 us on V3's.
_GPU_FP8_PAIRS = PairConfig(block_i=64, block_k=256, block_d=256, num_warps=8, num_stages=1)
# On an H200 (108 settings, the same op; bench/results/kernels/h200/logs-archive/fp8-pairs-sweep-h200-2026-11-28.log)
# 512-column gate/up steps and 512 outputs a down step keep more bytes in flight: V3's experts at one token
# 99.7 us (83% of copy) against 108.8 (76%) for the H100's setting, at four tokens 297.9 against 337.3;
# v2-lite's 24.3 against 27.7 and 54.6 against 59.5.
_H200_FP8_PAIRS = PairConfig(block_i=64, block_k=512, block_d=512, num_warps=8, num_stages=1)
# Up to this many pairs the per-pair path runs. It reads an expert's weights once per pair, the tiled path
# once per expert chosen, so the tiled path wins once pairs share experts often enough. On an H200, graph
# replays over 8 routings (bench/results/kernels/h200/logs-archive/fp8-moe-pair-limit-h200-2026-11-28.log):
# 32 experts of V3's shapes (top-8) 344.5 us against the tiled path's 360.1 at 32 pairs, 484.6 against
# 417.7 at 48; 64 of v2-lite's (top-6) 86.6 against 115.3 at 36. Real models have more experts than these
# 32 / 64, so fewer pairs share one and the per-pair path gains there.
FP8_PAIR_MAX_PAIRS = 32
# Under the interpreter a program's cost is per operation: tiles as wide as the tests' small experts
# allow while still taking several programs and steps (I 96 in three programs; K and D steps of 64 over
# D 160, the last partial).
_INTERPRETER_FP8_PAIRS = PairConfig(block_i=32, block_k=64, block_d=64, num_warps=4, num_stages=1)


def fp8_pair_config(device: torch.device) -> PairConfig:
    """The FP8 per-pair path's launch configuration on `device`."""
    if device.type != "cuda":
        return _INTERPRETER_FP8_PAIRS
    return _H200_FP8_PAIRS if h200(device) else _GPU_FP8_PAIRS


def pair_block_i(config: PairConfig, block: tuple[int, int]) -> int:
    """The intermediate columns a program takes for scale blocks `block` (bn, bk): the config's, at most bk.
    Both are powers of two (`fp8_linear.check_block_k`), so they divide bk: one K block of w2."""
    return min(config.block_i, block[1])


@triton.jit
def pair_program(ids_ptr, weights_ptr, inter, s_ids_t, s_ids_k, s_tw_t, s_tw_k,
                 TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, GDC: tl.constexpr):
    """A per-pair program's (token, slot) pair and intermediate columns, read after the kernel before it
    (GDC): (token [int64], expert [int64; -1: none], its router weight [float32], the columns offs_i
    [BLOCK_I] and their mask, the gate rows of w13 they read (row 0 past I, whose activation is zeroed) and
    the up rows). The quantized per-pair paths' (this module's and `fp4_pairs`') shared start."""
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    slot = pair % TOP_K
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    expert = tl.load(ids_ptr + token * s_ids_t + slot * s_ids_k).to(tl.int64)
    router = tl.load(weights_ptr + token * s_tw_t + slot * s_tw_k).to(tl.float32)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < inter
    gate_rows = tl.where(i_mask, offs_i, 0)
    return token, expert, router, offs_i, i_mask, gate_rows, gate_rows + inter


@triton.jit
def _fp8_pair_kernel(
    x_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, inter, limit,
    s_xt, s_xd, s_ge, s_gn, s_gd, s_gse, s_gsn, s_gsk, s_de, s_dd, s_di, s_dse, s_dsn, s_dsk,
    s_ids_t, s_ids_k, s_tw_t, s_tw_k, s_ot,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_K: tl.constexpr, X_DTYPE: tl.constexpr, CLAMP: tl.constexpr, GDC: tl.constexpr,
):
    """One (token, slot) pair, BLOCK_I of its expert's intermediate columns: gate/up, activation, down.

    A gate/up step of BLOCK_K columns is BLOCK_K // GROUP_K runs of GROUP_K columns, each inside one
    scale block (GROUP_K = min(BLOCK_K, SCALE_K)); its products are summed a run at a time and scaled.
    """
    token, expert, router, offs_i, i_mask, gate_rows, up_rows = pair_program(
        ids_ptr, weights_ptr, inter, s_ids_t, s_ids_k, s_tw_t, s_tw_k, TOP_K, BLOCK_I, GDC)
    if expert >= 0:
        # Out-of-range columns read row 0 (their activation is zeroed below): no mask on the weight rows.
        w_gate = w13_ptr + expert * s_ge + gate_rows[:, None].to(tl.int64) * s_gn
        w_up = w13_ptr + expert * s_ge + up_rows[:, None].to(tl.int64) * s_gn
        # Gate and up rows of one column may lie in different row blocks of w13.
        s_gate = s13_ptr + expert * s_gse + (gate_rows // SCALE_N) * s_gsn
        s_up = s13_ptr + expert * s_gse + (up_rows // SCALE_N) * s_gsn
        x_row = x_ptr + token * s_xt
        offs_k = tl.arange(0, BLOCK_K)
        acc_gate = tl.zeros([BLOCK_I, BLOCK_K // GROUP_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_I, BLOCK_K // GROUP_K], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < hidden
            xk = tl.load(x_row + ks * s_xd, mask=k_mask, other=0.0).to(tl.float32)
            gate = tl.load(w_gate + ks[None, :] * s_gd, mask=k_mask[None, :], other=0.0)
            up = tl.load(w_up + ks[None, :] * s_gd, mask=k_mask[None, :], other=0.0)
            acc_gate += scaled_row_step(gate, xk, s_gate, k0, hidden, s_gsk, BLOCK_I, BLOCK_K, SCALE_K, GROUP_K)
            acc_up += scaled_row_step(up, xk, s_up, k0, hidden, s_gsk, BLOCK_I, BLOCK_K, SCALE_K, GROUP_K)
        act = swiglu_activation(tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1), limit, X_DTYPE, CLAMP)
        act = tl.where(i_mask, act.to(tl.float32), 0.0)
        # The program's columns are one K block of w2 (BLOCK_I divides SCALE_K): one scale an output column.
        w_down = w2_ptr + expert * s_de + offs_i[None, :] * s_di
        s_down = s2_ptr + expert * s_dse + (tl.program_id(1) * BLOCK_I // SCALE_K) * s_dsk
        offs_d = tl.arange(0, BLOCK_D)
        out_row = out_ptr + token * s_ot
        for d0 in range(0, hidden, BLOCK_D):
            ds = d0 + offs_d
            d_mask = ds < hidden
            w = tl.load(w_down + ds[:, None].to(tl.int64) * s_dd, mask=d_mask[:, None] & i_mask[None, :], other=0.0)
            d_scale = tl.load(s_down + (ds // SCALE_N) * s_dsn, mask=d_mask, other=0.0)
            part = tl.sum(w.to(tl.float32) * act[None, :], axis=1) * (d_scale * router)
            tl.atomic_add(out_row + ds, part, mask=d_mask, sem="relaxed")


def fp8_pair_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                 w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 block: tuple[int, int], block_i: int, config: PairConfig, limit: float | None) -> torch.Tensor:
    """The per-pair path on inputs `fp8_moe.fp8_fused_moe` checked: x [T, D], w13 [E, 2I, D] and w2 [E, D, I]
    float8_e4m3fn with their scales, topk_weights / topk_ids [T, k] -> a float32 [T, D] (a zeroed row summed
    into). block_i from `pair_block_i`."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    out = zeros((num_tokens, hidden), torch.float32, x.device)
    use_pdl = pdl(x.device)
    # Steps of several scale blocks are whole blocks (both are powers of two); a step inside one block
    # divides it.
    block_k = min(config.block_k, max(16, next_pow2(hidden)))
    _fp8_pair_kernel[(topk_ids.numel(), triton.cdiv(inter, block_i))](
        x, w13, w13_scale_inv, w2, w2_scale_inv, topk_ids, topk_weights, out,
        hidden, inter, 0.0 if limit is None else float(limit),
        *x.stride(), *w13.stride(), *w13_scale_inv.stride(), *w2.stride(), *w2_scale_inv.stride(),
        *topk_ids.stride(), *topk_weights.stride(), out.stride(0),
        SCALE_N=block[0], SCALE_K=block[1], TOP_K=topk_ids.shape[1], BLOCK_I=block_i,
        BLOCK_K=block_k, BLOCK_D=min(config.block_d, max(16, next_pow2(hidden))),
        GROUP_K=min(block_k, block[1]), X_DTYPE=TL_DTYPES[x.dtype], CLAMP=limit is not None, GDC=use_pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    return out
