"""The absorbed decode query in one launch: per-head q_nope @ W_UK, written beside q_pe.

Unfused this is a batched GEMM of one row per head at batch 1 (a few
microseconds of launch-bound cuBLAS work) and a concatenation; here each program
multiplies a tile of sequences of one head by a column tile of that head's W_UK
and the first column tile's programs also copy q_pe into the output's tail.
The tile (`absorb_tile`) also reads W_UK as a stacked FP8 pair, for the latent
write's fused query (`latent.write_latent_absorb`); `absorb_query` sends a pair
to `fp8_heads.fp8_absorb_query`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..quantized import BlockFP8Weight, Weight, dequantized
from ._common import check_float, dot_precision, next_pow2, pdl
from .fp8_heads import fp8_absorb_query, head_tile

# W_UK columns per program.
ABSORB_BLOCK_C = 64


@triton.jit
def absorb_tile(
    head, col_block, seq_block, qn_ptr, qpe_ptr, w_ptr, ws_ptr, out_ptr,
    num_seqs,
    s_nb, s_nh, s_nd, s_pb, s_ph, s_pr, s_wh, s_wd, s_wc, s_sh, s_sd, s_sc, s_ob, s_oh, s_oc,
    NOPE_DIM: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr, COPY_PE: tl.constexpr,
    W_FP8: tl.constexpr, SCALE_D: tl.constexpr, SCALE_C: tl.constexpr,
    ONE_D_BLOCK: tl.constexpr, ONE_C_BLOCK: tl.constexpr,
):
    """out[seqs, head, cols] = q_nope[seqs, head] @ W_UK[head][:, cols] for one tile, W_UK a 16-bit weight or
    (W_FP8) an FP8 pair's values with their scales at ws_ptr (`fp8_heads.head_tile`); with COPY_PE the first
    column block also copies q_pe into the tail. Waits for the previous kernel (GDC) after loading W_UK."""
    seqs = seq_block * BLOCK_B + tl.arange(0, BLOCK_B)
    seq_mask = seqs < num_seqs
    seqs64 = seqs.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < NOPE_DIM
    col0 = col_block * BLOCK_C
    cols = col0 + tl.arange(0, BLOCK_C)
    col_mask = cols < KV_LORA_RANK
    # The weight tile and its scales depend on no earlier kernel: in flight before the wait.
    w = head_tile(w_ptr + head * s_wh, ws_ptr + head * s_sh, d, cols, 0, col0, d_mask, col_mask, s_wd, s_wc,
                  s_sd, s_sc, qn_ptr.dtype.element_ty, W_FP8, SCALE_D, SCALE_C, ONE_D_BLOCK, ONE_C_BLOCK)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    q = tl.load(qn_ptr + seqs64[:, None] * s_nb + head * s_nh + d[None, :] * s_nd,
                mask=seq_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.dot(q, w, input_precision=DOT_PRECISION)
    out_rows = out_ptr + seqs64[:, None] * s_ob + head * s_oh
    tl.store(out_rows + cols[None, :] * s_oc, acc.to(out_ptr.dtype.element_ty),
             mask=seq_mask[:, None] & col_mask[None, :])
    if COPY_PE and col_block == 0:
        r = tl.arange(0, BLOCK_R)
        r_mask = seq_mask[:, None] & (r < ROPE_DIM)[None, :]
        pe = tl.load(qpe_ptr + seqs64[:, None] * s_pb + head * s_ph + r[None, :] * s_pr, mask=r_mask)
        tl.store(out_rows + (KV_LORA_RANK + r[None, :]) * s_oc, pe.to(out_ptr.dtype.element_ty), mask=r_mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _absorb_kernel(
    qn_ptr, qpe_ptr, w_ptr, out_ptr,
    num_seqs,
    s_nb, s_nh, s_nd, s_pb, s_ph, s_pr, s_wh, s_wd, s_wc, s_ob, s_oh, s_oc,
    NOPE_DIM: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr,
):
    # A 16-bit W_UK (pairs take `fp8_heads.fp8_absorb_query`): no scales.
    absorb_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), qn_ptr, qpe_ptr, w_ptr, w_ptr, out_ptr,
                num_seqs, s_nb, s_nh, s_nd, s_pb, s_ph, s_pr, s_wh, s_wd, s_wc, 0, 0, 0, s_ob, s_oh, s_oc,
                NOPE_DIM, KV_LORA_RANK, ROPE_DIM, BLOCK_B, BLOCK_D, BLOCK_C, BLOCK_R, DOT_PRECISION, GDC, True,
                False, 1, 1, True, True)


def absorb_block_b(num_seqs: int) -> int:
    """Sequences per program: up to 64 share a W_UK tile; tl.dot needs at least 16 rows."""
    return min(64, max(16, next_pow2(num_seqs)))


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: Weight) -> torch.Tensor:
    """Contract of `reference.attention.absorb_query`, in one launch.

    q_nope [B, H, Dn], q_pe [B, H, R] (any strides), w_uk [H, Dn, C], one float dtype, or a stacked
    FP8 pair (`fp8_heads.fp8_absorb_query`) -> a new contiguous q [B, H, C + R]; products in float32,
    rounded once.
    """
    if isinstance(w_uk, BlockFP8Weight):
        return fp8_absorb_query(q_nope, q_pe, w_uk)
    w_uk = dequantized(w_uk, q_nope.dtype)
    num_heads, nope_dim, kv_lora_rank = w_uk.shape
    num_seqs = q_nope.shape[0]
    check_shape("q_nope", q_nope, (num_seqs, num_heads, nope_dim))
    check_shape("q_pe", q_pe, (num_seqs, num_heads, None))
    check_float("q_nope", q_nope)
    check_dtype("q_pe", q_pe, (q_nope.dtype,))
    check_dtype("w_uk", w_uk, (q_nope.dtype,))
    check_same_device(q_nope=q_nope, q_pe=q_pe, w_uk=w_uk)
    rope_dim = q_pe.shape[2]
    out = torch.empty((num_seqs, num_heads, kv_lora_rank + rope_dim), dtype=q_nope.dtype, device=q_nope.device)
    if num_seqs == 0:
        return out
    block_b = absorb_block_b(num_seqs)
    grid = (num_heads, triton.cdiv(kv_lora_rank, ABSORB_BLOCK_C), triton.cdiv(num_seqs, block_b))
    use_pdl = pdl(q_nope.device)
    _absorb_kernel[grid](
        q_nope, q_pe, w_uk, out,
        num_seqs,
        *q_nope.stride(), *q_pe.stride(), *w_uk.stride(), *out.stride(),
        NOPE_DIM=nope_dim, KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim,
        BLOCK_B=block_b, BLOCK_D=max(16, next_pow2(nope_dim)), BLOCK_C=ABSORB_BLOCK_C,
        BLOCK_R=max(16, next_pow2(rope_dim)), DOT_PRECISION=dot_precision(q_nope.dtype), GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
    return out
