"""Rotary embedding of q_pe and k_pe in one launch.

The reference spends some twenty elementwise kernels a layer on this (gathers of
the tables, casts, strided halves, a concatenation); at decode batch sizes each
is a few microseconds of launch-bound time, which one program per token removes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_same_device, check_shape
from ._common import check_float, next_pow2


@triton.jit
def rope_angles(cos_ptr, sin_ptr, pos, s_ct, s_st, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """cos and sin [HALF] (float32) at `pos`, and the offsets of each pair's two halves in the input."""
    i = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * s_ct + i).to(tl.float32)
    sin = tl.load(sin_ptr + pos * s_st + i).to(tl.float32)
    if INTERLEAVED:
        return cos, sin, 2 * i, 2 * i + 1
    return cos, sin, i, i + HALF


@triton.jit
def rotate_heads(q_row, out_row, num_heads, s_qh, s_qd, s_qoh, cos, sin, first, second,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate one token's [num_heads, 2 * HALF] rows at q_row into out_row (half-split layout)."""
    i = tl.arange(0, HALF)
    heads = tl.arange(0, BLOCK_H)
    hmask = (heads < num_heads)[:, None]
    q_row = q_row + heads[:, None] * s_qh
    x1 = tl.load(q_row + first[None, :] * s_qd, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(q_row + second[None, :] * s_qd, mask=hmask, other=0.0).to(tl.float32)
    out_row = out_row + heads[:, None] * s_qoh
    out_ty = out_row.dtype.element_ty
    tl.store(out_row + i[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=hmask)
    tl.store(out_row + HALF + i[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=hmask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    num_heads,
    s_qt, s_qh, s_qd, s_kt, s_kd, s_qot, s_qoh, s_kot, s_ct, s_st,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c, s, first, second = rope_angles(cos_ptr, sin_ptr, pos, s_ct, s_st, HALF, INTERLEAVED)
    rotate_heads(q_ptr + t * s_qt, q_out_ptr + t * s_qot, num_heads, s_qh, s_qd, s_qoh, c, s, first, second,
                 HALF, BLOCK_H)
    i = tl.arange(0, HALF)
    k1 = tl.load(k_ptr + t * s_kt + first * s_kd).to(tl.float32)
    k2 = tl.load(k_ptr + t * s_kt + second * s_kd).to(tl.float32)
    tl.store(k_out_ptr + t * s_kot + i, (k1 * c - k2 * s).to(k_out_ptr.dtype.element_ty))
    tl.store(k_out_ptr + t * s_kot + HALF + i, (k2 * c + k1 * s).to(k_out_ptr.dtype.element_ty))
    if REST > 0:
        # Dims past the rotated ones (`partial_rope`) are copied as they are.
        j = 2 * HALF + tl.arange(0, BLOCK_REST)
        j_mask = j < 2 * HALF + REST
        heads = tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & j_mask[None, :]
        qv = tl.load(q_ptr + t * s_qt + heads[:, None] * s_qh + j[None, :] * s_qd, mask=mask)
        tl.store(q_out_ptr + t * s_qot + heads[:, None] * s_qoh + j[None, :], qv, mask=mask)
        kv = tl.load(k_ptr + t * s_kt + j * s_kd, mask=j_mask)
        tl.store(k_out_ptr + t * s_kot + j, kv, mask=j_mask)


def _check_tables(num_tokens: int, rope_dim: int, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, name: str) -> int:
    """half = rope_dim / 2, after checking the tables and that half is a power of two."""
    half = rope_dim // 2
    check_shape("positions", positions, (num_tokens,))
    check_shape("cos", cos, (None, half))
    check_shape("sin", sin, tuple(cos.shape))
    if rope_dim % 2 or half < 1 or half & (half - 1):
        raise ValueError(f"{name}: expected a rope dim of twice a power of two, got {rope_dim}")
    return half


def _launch(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, positions: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, half: int, interleaved: bool) -> None:
    num_tokens, num_heads, dim = q.shape
    rest = dim - 2 * half
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos, sin,
            num_heads,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), cos.stride(0), sin.stride(0),
            HALF=half, INTERLEAVED=interleaved, BLOCK_H=next_pow2(num_heads),
            REST=rest, BLOCK_REST=next_pow2(rest) if rest else 1,
        )


def rope(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q_pe [T, H, R] and k_pe [T, R] (any strides) by the angles at `positions` [T].

    cos, sin: [max_positions, R / 2] float tables; R / 2 must be a power of two.
    returns   new contiguous (q_pe [T, H, R], k_pe [T, R]) in the half-split layout,
              as the reference: rotation in float32, rounded once to the input dtype.
    """
    num_tokens, _, rope_dim = q_pe.shape
    check_shape("k_pe", k_pe, (num_tokens, rope_dim))
    half = _check_tables(num_tokens, rope_dim, positions, cos, sin, "q_pe")
    check_float("q_pe", q_pe)
    check_float("k_pe", k_pe)
    check_same_device(q_pe=q_pe, k_pe=k_pe, positions=positions, cos=cos, sin=sin)
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    k_out = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
    _launch(q_pe, k_pe, q_out, k_out, positions, cos, sin, half, interleaved)
    return q_out, k_out


def partial_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.rope.partial_rope`, in the same one launch as `rope`.

    q [T, H, D], k [T, D] (any strides); the first rotary_dim dims rotated as `rope`
    rotates them (half-split out), the others copied -> new contiguous (q, k). Where the
    reference rotates slices and concatenates, this writes whole rows once.
    """
    num_tokens, _, dim = q.shape
    check_shape("k", k, (num_tokens, dim))
    if not 0 < rotary_dim <= dim:
        raise ValueError(f"rotary_dim: expected 1..{dim} (the head dim), got {rotary_dim}")
    half = _check_tables(num_tokens, rotary_dim, positions, cos, sin, "rotary_dim")
    check_float("q", q)
    check_float("k", k)
    check_same_device(q=q, k=k, positions=positions, cos=cos, sin=sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, q_out, k_out, positions, cos, sin, half, interleaved)
    return q_out, k_out
