"""Batch-invariant matmul: each output row is reduced over K in one fixed order for any row count.

cuBLAS picks its algorithm (tile shape, split-K) by the problem size, and our
few-row GEMV is a different kernel again, so a row's bits depend on how many rows
share the call. Here every call accumulates K in ascending order in float32 with
`tl.dot`, with no split-K: the row count (and the content of the other rows) only
decides how many programs run, never the order of a row's additions. `tl.dot`
accumulates one 16-wide step of K after another whatever the tile, so the tile's
rows, columns and K step follow the row count for speed without changing a row's
bits (measured on an H100 across 16..128 rows, 16..256 columns, K steps of
16..256; the GPU tests check it bit for bit across row counts).

One kernel serves the dense projections (`linear`), the per-head batched
products of MLA (`bmm`: W_UK absorption, W_UV) and nothing else, so every
product of a batch-invariant step reduces the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import check_float, dot_precision, pdl

@dataclass(frozen=True, slots=True)
class InvariantTile:
    """One program's output tile (rows, columns), its K step, warps and pipeline depth."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Chosen on an H100 (bench/results/step/h100/logs-archive/invariant-probe-h100-2026-11-23.log). Few
# rows: 16-column tiles and long K steps, so a weight read at decode sizes spreads
# over every multiprocessor in few, large loads (a 2048 x 2048 bf16 weight at one
# row: 4.4 us, the GEMV 3.0 us; 16 rows: 4.4 us, cuBLAS 5.4 us). Many rows: square
# tiles that reuse each loaded tile.
_FEW_ROWS = InvariantTile(block_m=16, block_n=16, block_k=256, num_warps=4, num_stages=4)
_SOME_ROWS = InvariantTile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
_MANY_ROWS = InvariantTile(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
_INTERPRETER_TILE = InvariantTile(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def invariant_tile(num_rows: int, device: torch.device) -> InvariantTile:
    """The output tile for `num_rows` rows (it changes speed, not bits)."""
    if device.type != "cuda":
        return _INTERPRETER_TILE
    if num_rows <= 16:
        return _FEW_ROWS
    return _SOME_ROWS if num_rows <= 256 else _MANY_ROWS


# The row count follows the batch: a plain argument, not one compile per count.
@triton.jit(do_not_specialize=["num_rows"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    num_rows, n_out, k_in,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr,
):
    """c[g] = a[g] @ b[g] for batch g = program_id(2); a [M, K], b [K, N] through strides."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(2).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    col_mask = cols < n_out
    row_mask = rows < num_rows
    a_rows = a_ptr + g * s_ab + rows[:, None].to(tl.int64) * s_am
    b_cols = b_ptr + g * s_bb + cols[None, :].to(tl.int64) * s_bn
    # The weight depends on no earlier kernel: its first tile is in flight before the wait.
    b = tl.load(b_cols + ks[:, None] * s_bk, mask=(ks < k_in)[:, None] & col_mask[None, :], other=0.0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    a = tl.load(a_rows + ks[None, :] * s_ak, mask=row_mask[:, None] & (ks < k_in)[None, :], other=0.0)
    acc = tl.dot(a, b, input_precision=DOT_PRECISION)
    for k0 in range(BLOCK_K, k_in, BLOCK_K):
        kk = k0 + ks
        k_mask = kk < k_in
        a = tl.load(a_rows + kk[None, :] * s_ak, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + kk[:, None] * s_bk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    tl.store(c_ptr + g * s_cb + rows[:, None].to(tl.int64) * s_cm + cols[None, :] * s_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
        tile: InvariantTile | None = None) -> torch.Tensor:
    """c[g] = a[g] @ b[g], each row reduced over K in the fixed order (any strides).

    a [G, M, K], b [G, K, N], one float dtype -> c [G, M, N] in a's dtype (or into
    `out`, any strides, for callers that want another layout or dtype); products
    in float32 (IEEE for float32 inputs), rounded once.
    """
    groups, num_rows, k_in = a.shape
    n_out = b.shape[2]
    check_shape("b", b, (groups, k_in, n_out))
    check_float("a", a)
    check_dtype("b", b, (a.dtype,))
    check_same_device(a=a, b=b)
    if out is None:
        out = torch.empty((groups, num_rows, n_out), dtype=a.dtype, device=a.device)
    else:
        check_shape("out", out, (groups, num_rows, n_out))
        check_float("out", out)
        check_same_device(a=a, out=out)
    if groups == 0 or num_rows == 0 or n_out == 0:
        return out
    if k_in == 0:
        return out.zero_()
    tile = tile or invariant_tile(num_rows, a.device)
    use_pdl = pdl(a.device)
    grid = (triton.cdiv(n_out, tile.block_n), triton.cdiv(num_rows, tile.block_m), groups)
    _matmul_kernel[grid](
        a, b, out,
        num_rows, n_out, k_in,
        *a.stride(), *b.stride(), *out.stride(),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        DOT_PRECISION=dot_precision(a.dtype), GDC=use_pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=use_pdl,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Contract of `reference.linear.linear`, batch-invariant: y[t] depends on x[t] and weight only.

    x [T, K], weight [N, K] (any strides) -> y [T, N] in x's dtype, or with `out_dtype`
    computed from both inputs widened to it (router logits in float32).
    """
    check_shape("weight", weight, (None, x.shape[1]))
    check_float("x", x)
    if out_dtype is None:
        check_dtype("weight", weight, (x.dtype,))
    else:
        check_float("weight", weight)
        x, weight = x.to(out_dtype), weight.to(out_dtype)
    return bmm(x.unsqueeze(0), weight.t().unsqueeze(0))[0]
