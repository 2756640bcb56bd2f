"""The latent's columns in four chunks: tile functions the MLA decode kernels share.

Below 64 heads a program's tiles are narrower than Hopper's warpgroup MMA, and a score taken as one
512-deep product chain waits on each product in turn. Here the latent's C columns come in CHUNKS
chunks (four, or one: the whole row), each with its own query slice, score product and value
accumulator (a0..a3), so that four chains a quarter as deep run side by side. Over an FP8 cache
each chunk is one scale group, dequantized as it is loaded (`latent_parts.latent_values`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import LN2, online_softmax_weights
from .latent_parts import latent_values


@triton.jit
def query_columns(q_row, head_mask, c0, limit, s_qd, WIDTH: tl.constexpr):
    """Columns [c0, c0 + WIDTH) of the queries at `q_row` [BLOCK_H, 1] (zeros past limit or a head)."""
    cols = c0 + tl.arange(0, WIDTH)
    return tl.load(q_row + cols[None, :] * s_qd, mask=head_mask[:, None] & (cols[None, :] < limit), other=0.0)


@triton.jit
def scaled_scores(q, k, scale_log2, DOT_PRECISION: tl.constexpr):
    # Scaled on its own: a raw sum of products would be folded back into one accumulator chain.
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2


@triton.jit
def attend_tile(q0, q1, q2, q3, q_pe, v_row, sc_row, r_row, key_mask, m_i, l_i, a0, a1, a2, a3, scale_log2,
                s_vd, s_scd, s_rd,
                KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
                CHUNKS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """One tile of the base-2 online softmax over the latent rows at `v_row` (scales at `sc_row`, RoPE
    values at `r_row`; where key_mask), the latent's columns in CHUNKS (4 or 1) chunks: folded into
    (m_i, l_i [BLOCK_H]; a0..a3 [BLOCK_H, CHUNK] float32; with one chunk, a1..a3 come back as they came)."""
    out_ty = r_row.dtype.element_ty
    k0 = latent_values(v_row, sc_row, key_mask, s_vd, s_scd, 0, CHUNK, KV_LORA_RANK, out_ty, FP8)
    k_pe = latent_values(r_row, r_row, key_mask, s_rd, s_rd, 0, BLOCK_R, ROPE_DIM, out_ty, False)
    if CHUNKS == 4:
        k1 = latent_values(v_row, sc_row, key_mask, s_vd, s_scd, CHUNK, CHUNK, KV_LORA_RANK, out_ty, FP8)
        k2 = latent_values(v_row, sc_row, key_mask, s_vd, s_scd, 2 * CHUNK, CHUNK, KV_LORA_RANK, out_ty, FP8)
        k3 = latent_values(v_row, sc_row, key_mask, s_vd, s_scd, 3 * CHUNK, CHUNK, KV_LORA_RANK, out_ty, FP8)
        scores = ((scaled_scores(q0, k0, scale_log2, DOT_PRECISION)
                   + scaled_scores(q1, k1, scale_log2, DOT_PRECISION))
                  + (scaled_scores(q2, k2, scale_log2, DOT_PRECISION)
                     + scaled_scores(q3, k3, scale_log2, DOT_PRECISION))
                  + scaled_scores(q_pe, k_pe, scale_log2, DOT_PRECISION))
    else:
        scores = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * scale_log2
    scores = tl.where(key_mask[None, :], scores, float("-inf"))
    m_new, l_i, alpha, p = online_softmax_weights(scores, m_i, l_i)
    p = p.to(k0.dtype)
    a0 = tl.dot(p, k0, a0 * alpha[:, None], input_precision=DOT_PRECISION)
    if CHUNKS == 4:
        a1 = tl.dot(p, k1, a1 * alpha[:, None], input_precision=DOT_PRECISION)
        a2 = tl.dot(p, k2, a2 * alpha[:, None], input_precision=DOT_PRECISION)
        a3 = tl.dot(p, k3, a3 * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def store_columns(po_row, a, l_i, c0, limit, head_mask, s_pod, CHUNK: tl.constexpr):
    """Columns [c0, c0 + CHUNK) of the split's output, a / l_i, at `po_row` [BLOCK_H, 1] (below limit)."""
    cols = c0 + tl.arange(0, CHUNK)
    tl.store(po_row + cols[None, :] * s_pod, (a / l_i[:, None]).to(po_row.dtype.element_ty),
             mask=head_mask[:, None] & (cols[None, :] < limit))


@triton.jit
def chunked_queries(q_row, head_mask, s_qd, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
                    CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr):
    """The queries at `q_row` [BLOCK_H, 1] as `attend_tile` takes them: (q0..q3 [BLOCK_H, CHUNK], q_pe
    [BLOCK_H, BLOCK_R]); with one chunk q1..q3 are q0 again (they only pass through and compile away)."""
    q0 = query_columns(q_row, head_mask, 0, KV_LORA_RANK, s_qd, CHUNK)
    q_pe = query_columns(q_row, head_mask, KV_LORA_RANK, KV_LORA_RANK + ROPE_DIM, s_qd, BLOCK_R)
    if CHUNKS == 4:
        q1 = query_columns(q_row, head_mask, CHUNK, KV_LORA_RANK, s_qd, CHUNK)
        q2 = query_columns(q_row, head_mask, 2 * CHUNK, KV_LORA_RANK, s_qd, CHUNK)
        q3 = query_columns(q_row, head_mask, 3 * CHUNK, KV_LORA_RANK, s_qd, CHUNK)
    else:
        q1, q2, q3 = q0, q0, q0
    return q0, q1, q2, q3, q_pe


@triton.jit
def store_split(po_row, pl_row, m_i, l_i, a0, a1, a2, a3, head_mask, s_pod,
                KV_LORA_RANK: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """A split's normalised output (a0..a3 / l_i) at `po_row` [BLOCK_H, 1] and its natural-log LSE at
    `pl_row` [BLOCK_H] (-inf, and an output of 0, for a head that saw no key)."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    store_columns(po_row, a0, l_safe, 0, KV_LORA_RANK, head_mask, s_pod, CHUNK)
    if CHUNKS == 4:
        store_columns(po_row, a1, l_safe, CHUNK, KV_LORA_RANK, head_mask, s_pod, CHUNK)
        store_columns(po_row, a2, l_safe, 2 * CHUNK, KV_LORA_RANK, head_mask, s_pod, CHUNK)
        store_columns(po_row, a3, l_safe, 3 * CHUNK, KV_LORA_RANK, head_mask, s_pod, CHUNK)
    tl.store(pl_row, lse, mask=head_mask)
