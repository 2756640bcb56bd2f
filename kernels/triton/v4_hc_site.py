"""DeepSeek-V4's mHC sites in two kernels: the write-back and the mixing dot products, then the weights and the norm.

Unfused, a site costs some fifteen launches of a few microseconds each at decode
sizes (the streams' float copy, their unit RMS, the mixing GEMV, the gates, the
collapse, the norm, and the write-back's casts, product, bmm and add), while the
bytes it moves are the streams (N * D values a token) and fn ((2 + N) * N * N * D
float32, read once). Here:

* `_streams_kernel`, on a grid (token blocks, slices of D): for each token of its block
  and each D-chunk of its slice, optionally writes the new streams (comb^T-mixed
  streams + post ⊗ out, rounded to the streams' dtype term by term as `expand` and the
  add are), and accumulates the slice's share of the row's sum of squares and of its
  (2 + N) * N dot products with fn into a workspace [T, S, 1 + (2 + N) * N] float32.
  The fn tile of a chunk is loaded once and serves every token of the block. From
  `_DOT_MIN_TOKENS` tokens on, `_streams_dot_kernel` does the same for a block of 16
  tokens at once, per stream a [16, BLOCK_D] tile, the dots as a float32-accurate
  (three-pass TF32) dot product with the [BLOCK_D, (2 + N) * N] slice of fn.
* `_site_kernel` (`_head_kernel` for the hyper head's sigmoid weights and plain collapse),
  one program per token on a GPU (a block of tokens under the interpreter): sums the
  slices' partials, scales the dots by the row's inverse RMS (unit_rms(x) @ fn^T =
  rsqrt(mean(x^2) + eps) * (x @ fn^T)), turns them into pre, post and comb
  (`v4_hc.hc_gates`, the same code as the weights-only kernel), collapses the streams
  with pre (rounded to the streams' dtype) and applies the weighted RMS norm: in
  registers when the row fits one tile, else in two passes over D.

The workspace is sized by static shapes only, so the wrappers are graph-capturable. The streams
pass's layout (`StreamsLayout`: which kernel, how D is sliced) follows the token count by default;
a caller may fix it, as the batch-invariant table does (`v4_invariant`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import check_float, next_pow2, pdl
from .v4_hc import hc_gates

_BLOCK_D = 64
_MAX_BLOCK_T = 16
# From this many tokens the streams pass takes a block of 16 at once through a dot product
# (`_streams_dot_kernel`); below, a token at a time. H200, N = 4, D = 4096, a whole write-back
# and site (bench/results/v4-step/h200/logs-archive/hc-streams-sweep-h200-2026-11-23.log): per token vs by blocks
# 12.8 vs 18.8 us at 1 token, 20.4 vs 19.5 at 4, 28.8 vs 19.9 at 8, 56 vs 27 at 64.
_DOT_MIN_TOKENS = 8
# Enough programs to spread fn's read over every SM at a handful of tokens; past that, whole
# rows per program keep the workspace small (prefill).
_TARGET_PROGRAMS = 512
# From this many tokens the site kernel loads its row's streams before the gates, not after: H200,
# V4-mini steps, batch 64 x 64K 2.21 ms against 2.23; at one token the row held through the gates
# costs more (9.1 us a site against 8.1), so a lone token loads it after.
_PRELOAD_MIN_TOKENS = 2
# The block kernel's loads are not software-pipelined: with D specialised (aligned, vectorised loads)
# the pipeliner's buffers for the column chunks took the write-back 138 KB of shared memory, one
# program a multiprocessor, where a decode program has one chunk. H200, 4 streams of 4096, us, a
# write-back + site at 64 tokens: 28.2 with D unspecialised, 32.2 specialised and pipelined, 21.1
# specialised in one stage; a site without write-back 22.3 -> 12.3; one token 10.7 -> 8.5
# (bench/results/v4-step/h200/logs-archive/hc-specialised-h200-2026-11-26.log).
_STREAMS_DOT_STAGES = 1
# The per-token kernels take up to this much of D in one tile (V4's 4096: the whole row, one
# round of loads instead of one a chunk and pass).
_MAX_SITE_BLOCK_D = 4096
_INTERPRETER_SITE_ROWS = 16


def _site_tile(n: int, dim: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) of the per-token kernels: at most 64 stream values a thread.

    H200, N = 4, D = 4096 (bench/results/v4-step/h200/logs-archive/hc-site-warps-h200-2026-11-23.log): the whole row
    on 8 warps takes 7.5 us a site kernel, 16 warps 9.9 us (its 20 Sinkhorn rounds of tiny
    reductions cost more the more warps share them), 1024-wide chunks on 4 warps 8.6 us.
    """
    block_d = min(_MAX_SITE_BLOCK_D, max(16, next_pow2(dim)))
    return block_d, max(4, min(16, block_d * max(2, next_pow2(n)) // 2048))


def _site_rows(num_tokens: int, device: torch.device) -> int:
    """Tokens a program of the site kernel: one on a GPU (the layout `_site_tile`'s warps were chosen
    for), up to _INTERPRETER_SITE_ROWS under the interpreter, whose cost is per operation, not per
    value: the 20 Sinkhorn rounds of one row cost what those of 16 rows cost."""
    return 1 if device.type == "cuda" else min(_INTERPRETER_SITE_ROWS, next_pow2(num_tokens))


# The token count and what follows from it are plain arguments (an eager step meets every count); D,
# the model's width, is specialised, so that the compiler knows its alignment and vectorises the loads
# and masks over it (see _STREAMS_DOT_STAGES for the figures).
@triton.jit(do_not_specialize=["num_tokens", "chunks"])
def _streams_kernel(
    streams_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, ws_ptr,
    num_tokens, dim, chunks,
    s_st, s_sn, s_sd, s_ot, s_od, s_pt, s_pn, s_ct, s_cr, s_cc, s_nt, s_nn, s_nd, s_fm, s_ff, s_wt, s_ws,
    N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, WRITE_BACK: tl.constexpr, PARTIALS: tl.constexpr, GDC: tl.constexpr,
):
    block = tl.program_id(0)
    piece = tl.program_id(1)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    kk = tl.arange(0, NP)
    k_ok = kk < N
    mm = tl.arange(0, MP)
    m_ok = mm < M
    rows = tl.arange(0, BLOCK_T)
    dots = tl.zeros([BLOCK_T, MP], tl.float32)
    squares = tl.zeros([BLOCK_T], tl.float32)
    for chunk in range(chunks):
        dd = (piece * chunks + chunk) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = dd < dim
        tile_ok = k_ok[:, None] & d_ok[None, :]
        if PARTIALS:
            w = tl.load(fn_ptr + mm[:, None, None] * s_fm + (kk[None, :, None] * dim + dd[None, None, :]) * s_ff,
                        mask=m_ok[:, None, None] & tile_ok[None, :, :], other=0.0)          # [MP, NP, BLOCK_D]
        for i in range(BLOCK_T):
            t = block * BLOCK_T + i
            t64 = t.to(tl.int64)
            # A token past the end masks everything through its limits (0 streams, 0 columns).
            n_lim = tl.where(t < num_tokens, N, 0)
            d_lim = tl.where(t < num_tokens, dim, 0)
            kt_ok = kk < n_lim
            dt_ok = dd < d_lim
            mask = kt_ok[:, None] & dt_ok[None, :]
            if WRITE_BACK:
                dtype = new_ptr.dtype.element_ty
                mixed = tl.zeros([NP, BLOCK_D], tl.float32)
                for j in tl.static_range(N):
                    s_j = tl.load(streams_ptr + t64 * s_st + j * s_sn + dd * s_sd, mask=dt_ok, other=0.0)
                    c_j = tl.load(comb_ptr + t64 * s_ct + j * s_cr + kk * s_cc, mask=kt_ok, other=0.0)
                    mixed += c_j.to(dtype).to(tl.float32)[:, None] * s_j.to(tl.float32)[None, :]
                p = tl.load(post_ptr + t64 * s_pt + kk * s_pn, mask=kt_ok, other=0.0).to(dtype).to(tl.float32)
                o = tl.load(out_ptr + t64 * s_ot + dd * s_od, mask=dt_ok, other=0.0).to(dtype).to(tl.float32)
                delta = (p[:, None] * o[None, :]).to(dtype).to(tl.float32)
                new = (mixed.to(dtype).to(tl.float32) + delta).to(dtype)
                tl.store(new_ptr + t64 * s_nt + kk[:, None] * s_nn + dd[None, :] * s_nd, new, mask=mask)
                x = new.to(tl.float32)
            else:
                x = tl.load(streams_ptr + t64 * s_st + kk[:, None] * s_sn + dd[None, :] * s_sd, mask=mask,
                            other=0.0).to(tl.float32)
            if PARTIALS:
                hit = rows == i
                dots += tl.where(hit[:, None], tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)[None, :], 0.0)
                squares += tl.where(hit, tl.sum(tl.sum(x * x, axis=1), axis=0), 0.0)
    if PARTIALS:
        tokens = block * BLOCK_T + rows
        t_ok = tokens < num_tokens
        row = ws_ptr + tokens.to(tl.int64) * s_wt + piece * s_ws
        tl.store(row, squares, mask=t_ok)
        tl.store(row[:, None] + 1 + mm[None, :], dots, mask=t_ok[:, None] & m_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "chunks"])
def _streams_dot_kernel(
    streams_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, ws_ptr,
    num_tokens, dim, chunks,
    s_st, s_sn, s_sd, s_ot, s_od, s_pt, s_pn, s_ct, s_cr, s_cc, s_nt, s_nn, s_nd, s_fm, s_ff, s_wt, s_ws,
    N: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, WRITE_BACK: tl.constexpr, PARTIALS: tl.constexpr, GDC: tl.constexpr,
):
    block = tl.program_id(0)
    piece = tl.program_id(1)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    mm = tl.arange(0, MP)
    m_ok = mm < M
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    t64 = tokens.to(tl.int64)
    dots = tl.zeros([BLOCK_T, MP], tl.float32)
    squares = tl.zeros([BLOCK_T], tl.float32)
    for chunk in range(chunks):
        dd = (piece * chunks + chunk) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = dd < dim
        mask = t_ok[:, None] & d_ok[None, :]                                              # [BLOCK_T, BLOCK_D]
        if WRITE_BACK:
            dtype = new_ptr.dtype.element_ty
            o = tl.load(out_ptr + t64[:, None] * s_ot + dd[None, :] * s_od, mask=mask, other=0.0)
            o = o.to(dtype).to(tl.float32)
        for k in tl.static_range(N):
            if WRITE_BACK:
                mixed = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
                for j in tl.static_range(N):
                    s_j = tl.load(streams_ptr + t64[:, None] * s_st + j * s_sn + dd[None, :] * s_sd, mask=mask,
                                  other=0.0)
                    c_jk = tl.load(comb_ptr + t64 * s_ct + j * s_cr + k * s_cc, mask=t_ok, other=0.0)
                    mixed += c_jk.to(dtype).to(tl.float32)[:, None] * s_j.to(tl.float32)
                p_k = tl.load(post_ptr + t64 * s_pt + k * s_pn, mask=t_ok, other=0.0).to(dtype).to(tl.float32)
                delta = (p_k[:, None] * o).to(dtype).to(tl.float32)
                new = (mixed.to(dtype).to(tl.float32) + delta).to(dtype)
                tl.store(new_ptr + t64[:, None] * s_nt + k * s_nn + dd[None, :] * s_nd, new, mask=mask)
                x = new.to(tl.float32)
            else:
                x = tl.load(streams_ptr + t64[:, None] * s_st + k * s_sn + dd[None, :] * s_sd, mask=mask,
                            other=0.0).to(tl.float32)
            if PARTIALS:
                w = tl.load(fn_ptr + mm[None, :] * s_fm + (k * dim + dd)[:, None] * s_ff,
                            mask=d_ok[:, None] & m_ok[None, :], other=0.0)              # [BLOCK_D, MP]
                # Three TF32 products (hi * hi + hi * lo + lo * hi): float32 accuracy on tensor cores.
                dots = tl.dot(x, w, dots, input_precision="tf32x3")
                squares += tl.sum(x * x, axis=1)
    if PARTIALS:
        row = ws_ptr + t64 * s_wt + piece * s_ws
        tl.store(row, squares, mask=t_ok)
        tl.store(row[:, None] + 1 + mm[None, :], dots, mask=t_ok[:, None] & m_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "slices", "iters"])
def _site_kernel(
    ws_ptr, streams_ptr, base_ptr, scale_ptr, w_ptr, x_ptr, post_ptr, comb_ptr,
    num_tokens, dim, slices, iters, hc_eps, norm_eps,
    s_wt, s_ws, s_st, s_sn, s_sd, s_w, s_xt, s_xd, s_pt, s_pn, s_ct, s_cr, s_cc,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr, PRELOAD: tl.constexpr, GDC: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    t = tokens.to(tl.int64)
    kk = tl.arange(0, NP)
    k_ok = kk < N
    r = kk[:, None]
    c = kk[None, :]
    inside = (r < N) & (c < N)
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < dim
    row_ok = t_ok[:, None, None] & k_ok[None, :, None]                             # [BLOCK_T, NP, 1]
    streams_rows = streams_ptr + t[:, None, None] * s_st + kk[None, :, None] * s_sn
    if PRELOAD:
        # The norm weight depends on no earlier kernel, and the rows' streams on no gate: both
        # loads are in flight while the partials are summed and the gates computed.
        w = tl.load(w_ptr + offs * s_w, mask=d_ok, other=0.0).to(tl.float32)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    if PRELOAD:
        tile = tl.load(streams_rows + offs[None, None, :] * s_sd, mask=row_ok & d_ok[None, None, :],
                       other=0.0).to(tl.float32)                                   # [BLOCK_T, NP, BLOCK_D]
    ss = tl.arange(0, BLOCK_S)
    squares = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    pre = tl.zeros([BLOCK_T, BLOCK_S, NP], tl.float32)
    post = tl.zeros([BLOCK_T, BLOCK_S, NP], tl.float32)
    comb = tl.zeros([BLOCK_T, BLOCK_S, NP, NP], tl.float32)
    for s0 in range(0, slices, BLOCK_S):
        s = s0 + ss
        s_ok = t_ok[:, None] & (s < slices)[None, :]                               # [BLOCK_T, BLOCK_S]
        row = ws_ptr + t[:, None] * s_wt + s[None, :] * s_ws
        squares += tl.load(row, mask=s_ok, other=0.0)
        lane_ok = s_ok[:, :, None] & k_ok[None, None, :]
        pre += tl.load(row[:, :, None] + 1 + kk[None, None, :], mask=lane_ok, other=0.0)
        post += tl.load(row[:, :, None] + 1 + N + kk[None, None, :], mask=lane_ok, other=0.0)
        comb += tl.load(row[:, :, None, None] + 1 + 2 * N + r[None, None, :, :] * N + c[None, None, :, :],
                        mask=s_ok[:, :, None, None] & inside[None, None, :, :], other=0.0)
    inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / (N * dim) + norm_eps)        # [BLOCK_T]
    pre, post, comb = hc_gates(tl.sum(pre, axis=1) * inv_rms[:, None], tl.sum(post, axis=1) * inv_rms[:, None],
                               tl.sum(comb, axis=1) * inv_rms[:, None, None], base_ptr, scale_ptr, iters, hc_eps,
                               N, NP)
    tl.store(post_ptr + t[:, None] * s_pt + kk[None, :] * s_pn, post, mask=t_ok[:, None] & k_ok[None, :])
    tl.store(comb_ptr + t[:, None, None] * s_ct + r[None, :, :] * s_cr + c[None, :, :] * s_cc, comb,
             mask=t_ok[:, None, None] & inside[None, :, :])

    weights = pre[:, :, None]                                                       # [BLOCK_T, NP, 1]
    dtype = streams_ptr.dtype.element_ty
    x_rows = x_ptr + t[:, None] * s_xt                                              # [BLOCK_T, 1]
    if ONE_TILE:
        # The whole row (dim <= BLOCK_D) in one tile: the collapse stays in registers for the norm.
        if not PRELOAD:
            w = tl.load(w_ptr + offs * s_w, mask=d_ok, other=0.0).to(tl.float32)
            tile = tl.load(streams_rows + offs[None, None, :] * s_sd, mask=row_ok & d_ok[None, None, :],
                           other=0.0).to(tl.float32)
        col = tl.sum(weights * tile, axis=1).to(dtype).to(tl.float32)               # [BLOCK_T, BLOCK_D]
        inv = 1.0 / tl.sqrt(tl.sum(col * col, axis=1) / dim + norm_eps)
        normed = (col * inv[:, None]).to(dtype).to(tl.float32)
        tl.store(x_rows + offs[None, :] * s_xd, (w[None, :] * normed).to(x_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & d_ok[None, :])
    else:
        total = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            dd = d0 + offs
            tile = tl.load(streams_rows + dd[None, None, :] * s_sd, mask=row_ok & (dd < dim)[None, None, :],
                           other=0.0).to(tl.float32)
            col = tl.sum(weights * tile, axis=1).to(dtype).to(tl.float32)
            total += col * col
        inv = 1.0 / tl.sqrt(tl.sum(total, axis=1) / dim + norm_eps)
        # The second pass recomputes the collapse (the same values) rather than reading back stores.
        for d0 in range(0, dim, BLOCK_D):
            dd = d0 + offs
            d_ok = dd < dim
            tile = tl.load(streams_rows + dd[None, None, :] * s_sd, mask=row_ok & d_ok[None, None, :],
                           other=0.0).to(tl.float32)
            col = tl.sum(weights * tile, axis=1).to(dtype).to(tl.float32)
            normed = (col * inv[:, None]).to(dtype).to(tl.float32)
            w = tl.load(w_ptr + dd * s_w, mask=d_ok, other=0.0).to(tl.float32)
            tl.store(x_rows + dd[None, :] * s_xd, (w[None, :] * normed).to(x_ptr.dtype.element_ty),
                     mask=t_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["slices"])
def _head_kernel(
    ws_ptr, streams_ptr, base_ptr, scale_ptr, y_ptr,
    dim, slices, hc_eps, norm_eps,
    s_wt, s_ws, s_st, s_sn, s_sd, s_yt, s_yd,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    kk = tl.arange(0, NP)
    k_ok = kk < N
    ss = tl.arange(0, BLOCK_S)
    squares = tl.zeros([BLOCK_S], tl.float32)
    dots = tl.zeros([BLOCK_S, NP], tl.float32)
    for s0 in range(0, slices, BLOCK_S):
        s = s0 + ss
        s_ok = s < slices
        row = ws_ptr + t * s_wt + s * s_ws
        squares += tl.load(row, mask=s_ok, other=0.0)
        dots += tl.load(row[:, None] + 1 + kk[None, :], mask=s_ok[:, None] & k_ok[None, :], other=0.0)
    inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / (N * dim) + norm_eps)
    mixes = tl.sum(dots, axis=0) * inv_rms
    pre = tl.sigmoid(mixes * tl.load(scale_ptr).to(tl.float32) + tl.load(base_ptr + kk, mask=k_ok, other=0.0)) + hc_eps
    weights = tl.where(k_ok, pre, 0.0)[:, None]                                     # [NP, 1]
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, dim, BLOCK_D):
        dd = d0 + offs
        d_ok = dd < dim
        tile = tl.load(streams_ptr + t * s_st + kk[:, None] * s_sn + dd[None, :] * s_sd,
                       mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        tl.store(y_ptr + t * s_yt + dd * s_yd, tl.sum(weights * tile, axis=0).to(y_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True, slots=True)
class StreamsLayout:
    """How the streams pass covers [T, N, D]: its tokens a block at a time through the dot product
    (`_streams_dot_kernel`) or one at a time, block_t tokens a program, D in `slices` slices of `chunks`
    _BLOCK_D-wide chunks each (a row's partial sums follow the slices)."""

    block_dot: bool
    block_t: int
    slices: int
    chunks: int


def streams_layout(num_tokens: int, dim: int) -> StreamsLayout:
    """The layout for `num_tokens` tokens of width `dim`: the fastest, from static shapes only."""
    return StreamsLayout(_block_dot(num_tokens), *_geometry(num_tokens, dim))


def _block_dot(num_tokens: int) -> bool:
    """Whether the streams pass takes its tokens a block at a time (`_streams_dot_kernel`)."""
    return num_tokens >= _DOT_MIN_TOKENS


def _geometry(num_tokens: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_T, slices of D, chunks of _BLOCK_D a slice) for the streams kernel; static shapes only."""
    block_t = _MAX_BLOCK_T if _block_dot(num_tokens) else min(_MAX_BLOCK_T, next_pow2(num_tokens))
    total = triton.cdiv(dim, _BLOCK_D)
    slices = max(1, min(total, triton.cdiv(_TARGET_PROGRAMS, triton.cdiv(num_tokens, block_t))))
    chunks = triton.cdiv(total, slices)
    return block_t, triton.cdiv(total, chunks), chunks


def _check_streams(streams: torch.Tensor) -> tuple[int, int, int]:
    check_float("streams", streams)
    if streams.dim() != 3:
        raise ValueError(f"streams: expected shape (T, N, D), got {tuple(streams.shape)}")
    num_tokens, n, dim = streams.shape
    return num_tokens, n, dim


def _check_write_back(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> None:
    num_tokens, n, dim = streams.shape
    check_shape("post", post, (num_tokens, n))
    check_dtype("post", post, (torch.float32,))
    check_shape("comb", comb, (num_tokens, n, n))
    check_dtype("comb", comb, (torch.float32,))
    check_shape("out", out, (num_tokens, dim))
    check_float("out", out)
    check_same_device(post=post, comb=comb, out=out, streams=streams)


def _check_site(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm_weight: torch.Tensor, iters: int) -> None:
    _, n, dim = streams.shape
    width = (2 + n) * n
    check_shape("fn", fn, (width, n * dim))
    check_dtype("fn", fn, (torch.float32,))
    check_shape("base", base, (width,))
    check_dtype("base", base, (torch.float32,))
    check_shape("scale", scale, (3,))
    check_dtype("scale", scale, (torch.float32,))
    check_shape("norm_weight", norm_weight, (dim,))
    check_float("norm_weight", norm_weight)
    check_same_device(streams=streams, fn=fn, base=base, scale=scale, norm_weight=norm_weight)
    if iters < 1:
        raise ValueError(f"iters: expected >= 1, got {iters}")


def _workspace(streams: torch.Tensor, fn: torch.Tensor, layout: StreamsLayout | None = None) -> torch.Tensor:
    """The partials of `_streams_kernel` for `streams` [T, N, D] and fn [M, N * D]: [T, S, 1 + M] float32
    (S slices: `layout`'s, by default `streams_layout`'s)."""
    num_tokens, _, dim = streams.shape
    slices = (layout or streams_layout(num_tokens, dim)).slices
    return torch.empty((num_tokens, slices, 1 + fn.shape[0]), dtype=torch.float32, device=streams.device)


def _streams_pass(streams: torch.Tensor, write_back: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                  fn: torch.Tensor | None, ws: torch.Tensor | None, layout: StreamsLayout | None = None
                  ) -> torch.Tensor:
    """Launch `_streams_kernel` in `layout` (by default `streams_layout`'s), writing the partials into ws
    (with fn) -> the streams the site reads [T, N, D] (new ones with `write_back` = (post, comb, out), else
    `streams`)."""
    num_tokens, n, dim = streams.shape
    layout = layout or streams_layout(num_tokens, dim)
    block_t, slices, chunks = layout.block_t, layout.slices, layout.chunks
    width = 1 if fn is None else fn.shape[0]
    new = torch.empty_like(streams, memory_format=torch.contiguous_format) if write_back is not None else streams
    # Pointers a constexpr-disabled branch never reads are bound to `streams`.
    post, comb, out = write_back if write_back is not None else (streams[:, :, 0], streams, streams[:, 0])
    args = (streams, out, post, comb, new, streams if fn is None else fn, streams if ws is None else ws,
            num_tokens, dim, chunks,
            *streams.stride(), *out.stride(), *post.stride(), *comb.stride(), *new.stride(),
            *((0, 0) if fn is None else fn.stride()), *((0, 0) if ws is None else ws.stride()[:2]))
    meta = dict(N=n, M=width, BLOCK_T=block_t, BLOCK_D=_BLOCK_D, WRITE_BACK=write_back is not None,
                PARTIALS=fn is not None, GDC=pdl(streams.device), num_warps=4, launch_pdl=pdl(streams.device))
    if layout.block_dot:
        _streams_dot_kernel[(triton.cdiv(num_tokens, block_t), slices)](
            *args, MP=max(16, next_pow2(width)), num_stages=_STREAMS_DOT_STAGES, **meta)
    else:
        _streams_kernel[(triton.cdiv(num_tokens, block_t), slices)](
            *args, NP=max(2, next_pow2(n)), MP=max(2, next_pow2(width)), **meta)
    return new


def _site_pass(ws: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               norm_weight: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, n, dim = streams.shape
    slices = ws.shape[1]
    x = torch.empty((num_tokens, dim), dtype=torch.promote_types(norm_weight.dtype, streams.dtype),
                    device=streams.device)
    post = torch.empty((num_tokens, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((num_tokens, n, n), dtype=torch.float32, device=streams.device)
    block_d, num_warps = _site_tile(n, dim)
    block_t = _site_rows(num_tokens, streams.device)
    _site_kernel[(triton.cdiv(num_tokens, block_t),)](
        ws, streams, base.contiguous(), scale.contiguous(), norm_weight, x, post, comb,
        num_tokens, dim, slices, iters, hc_eps, norm_eps,
        *ws.stride()[:2], *streams.stride(), norm_weight.stride(0), *x.stride(), *post.stride(), *comb.stride(),
        N=n, NP=max(2, next_pow2(n)), BLOCK_T=block_t, BLOCK_S=min(64, next_pow2(slices)),
        BLOCK_D=block_d, ONE_TILE=dim <= block_d, PRELOAD=dim <= block_d and num_tokens >= _PRELOAD_MIN_TOKENS,
        GDC=pdl(streams.device), num_warps=num_warps,
        launch_pdl=pdl(streams.device),
    )
    return x, post, comb


def hc_site(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            norm_weight: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float,
            layout: StreamsLayout | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site (see `reference.v4_hc.hc_site`): streams [T, N, D]; fn [(2 + N) * N, N * D] float32;
    base [(2 + N) * N], scale [3] float32; norm_weight [D] -> (x [T, D] in promote(norm_weight, streams)
    dtype, post [T, N], comb [T, N, N] float32). Two launches; `layout`: the streams pass's
    (`streams_layout`'s by default)."""
    num_tokens, n, dim = _check_streams(streams)
    _check_site(streams, fn, base, scale, norm_weight, iters)
    if num_tokens == 0:
        return _empty_site(streams, norm_weight)
    ws = _workspace(streams, fn, layout)
    _streams_pass(streams, None, fn, ws, layout)
    return _site_pass(ws, streams, base, scale, norm_weight, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)


def hc_write_back(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor, *,
                  layout: StreamsLayout | None = None) -> torch.Tensor:
    """A sublayer's write-back (see `reference.v4_hc.hc_write_back`): post [T, N], comb [T, N, N] float32;
    out [T, D]; streams [T, N, D] -> the new streams [T, N, D] in streams' dtype. One launch, in `layout`
    (`streams_layout`'s by default)."""
    num_tokens, _, _ = _check_streams(streams)
    _check_write_back(post, comb, out, streams)
    if num_tokens == 0:
        return torch.empty_like(streams)
    return _streams_pass(streams, (post, comb, out), None, None, layout)


def hc_write_back_site(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor,
                       fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *,
                       iters: int, hc_eps: float, norm_eps: float, layout: StreamsLayout | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_write_back` then `hc_site` of the new streams (see `reference.v4_hc.hc_write_back_site`)
    -> (new streams [T, N, D], x [T, D], post [T, N], comb [T, N, N]). Two launches; `layout`: the streams
    pass's (`streams_layout`'s by default)."""
    num_tokens, _, _ = _check_streams(streams)
    _check_write_back(post, comb, out, streams)
    _check_site(streams, fn, base, scale, norm_weight, iters)
    if num_tokens == 0:
        return (torch.empty_like(streams), *_empty_site(streams, norm_weight))
    ws = _workspace(streams, fn, layout)
    new = _streams_pass(streams, (post, comb, out), fn, ws, layout)
    return (new, *_site_pass(ws, new, base, scale, norm_weight, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps))


def _empty_site(streams: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, n, dim = streams.shape
    device = streams.device
    return (torch.empty((0, dim), dtype=torch.promote_types(norm_weight.dtype, streams.dtype), device=device),
            torch.empty((0, n), dtype=torch.float32, device=device),
            torch.empty((0, n, n), dtype=torch.float32, device=device))


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
            norm_eps: float, layout: StreamsLayout | None = None) -> torch.Tensor:
    """The hyper head (see `reference.v4_hc.hc_head`): streams [T, N, D]; fn [N, N * D], base [N], scale [1]
    float32 -> [T, D] in the streams' dtype. Two launches; `layout`: the streams pass's (`streams_layout`'s
    by default)."""
    num_tokens, n, dim = _check_streams(streams)
    check_shape("fn", fn, (n, n * dim))
    check_dtype("fn", fn, (torch.float32,))
    check_shape("base", base, (n,))
    check_dtype("base", base, (torch.float32,))
    check_shape("scale", scale, (1,))
    check_dtype("scale", scale, (torch.float32,))
    check_same_device(streams=streams, fn=fn, base=base, scale=scale)
    y = torch.empty((num_tokens, dim), dtype=streams.dtype, device=streams.device)
    if num_tokens == 0:
        return y
    ws = _workspace(streams, fn, layout)
    _streams_pass(streams, None, fn, ws, layout)
    block_d, num_warps = _site_tile(n, dim)
    _head_kernel[(num_tokens,)](
        ws, streams, base.contiguous(), scale, y,
        dim, ws.shape[1], hc_eps, norm_eps,
        *ws.stride()[:2], *streams.stride(), *y.stride(),
        N=n, NP=max(2, next_pow2(n)), BLOCK_S=min(64, next_pow2(ws.shape[1])),
        BLOCK_D=block_d, GDC=pdl(streams.device), num_warps=num_warps, launch_pdl=pdl(streams.device),
    )
    return y
