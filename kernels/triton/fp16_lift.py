"""bf16 tiles lifted to fp16 exactly, so that FP8 weight tiles meet them as fp16.

Hopper widens e4m3 to fp16 in one instruction for two values (`cvt.rn.f16x2.e4m3x2`); to bf16 it
takes that and one more conversion a value. A product of a widened FP8 tile and a bf16 tile is
therefore cheaper as fp16 x fp16 (same tensor-core rate, float32 accumulation) when the bf16 tile
can be written in fp16 without loss: each line of the tile (a row of activations) is multiplied by
the power of two that puts its largest magnitude in [2^14, 2^15). A bf16 value has 8 significant
bits, so every value of the line above 2^-31 times its largest is then exact in fp16 (smaller ones
round on fp16's subnormal grid, below 2^-39 of the line's largest); the power of two is undone on
the float32 product, exactly. Used by the FP8 weight stream (`fp8_linear`), and, as a pass over whole rows
(`lift_rows`), by the FP4 experts' widened tiles (`fp4_widened`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_dtype
from ._common import next_pow2, power_of_two_scale


@triton.jit
def lift_to_fp16(x, AXIS: tl.constexpr):
    """x [A, B] (bf16) -> (x16 [A, B] fp16, unscale) with x == x16 * unscale along each line.

    A line runs along AXIS (AXIS 1: each row is a line, unscale [A]; AXIS 0: each column, unscale
    [B]). A line of zeros keeps unscale 1; infinities and NaN pass through as they are.
    """
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=AXIS)
    # 2^s puts amax in [2^14, 2^15).
    scale, unscale = power_of_two_scale(amax, 14)
    x16 = (xf * tl.expand_dims(scale, AXIS)).to(tl.float16)
    return x16, unscale


@triton.jit
def _lift_rows_kernel(x_ptr, out_ptr, unlift_ptr, num_cols, s_xr, s_xc, s_or, BLOCK: tl.constexpr,
                      ORDER_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    # Column j of the output from the input column whose bit i is bit ORDER_BITS[i] of j (the bits above kept).
    src = cols >> len(ORDER_BITS) << len(ORDER_BITS)
    for i in tl.static_range(len(ORDER_BITS)):
        src += ((cols >> ORDER_BITS[i]) & 1) << i
    x = tl.load(x_ptr + row * s_xr + src[None, :] * s_xc, mask=mask[None, :], other=0.0)
    x16, unscale = lift_to_fp16(x, 1)
    tl.store(out_ptr + row * s_or + cols[None, :], x16, mask=mask[None, :])
    tl.store(unlift_ptr + row + tl.arange(0, 1), unscale)


def lift_rows(x: torch.Tensor, order_bits: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] bf16 (any strides) -> (x16 [R, K] fp16 contiguous, unlift [R] float32): each row times the
    power of two that puts its largest magnitude in [2^14, 2^15), so x == x16 * unlift[:, None] for every
    value above 2^-31 times its row's largest (smaller ones round on fp16's subnormal grid). One program a
    row (K up to a few thousand).

    order_bits: a permutation of range(n) with K a multiple of 2^n: the columns of each run of 2^n permuted
    by their index's bits, x16[:, s + j] lifted from x[:, s + c] where bit i of c is bit order_bits[i] of j
    (the K order a kernel's operand takes, as `gluon.fp4_experts.K_ORDER_BITS`); () keeps x's order."""
    check_dtype("x", x, (torch.bfloat16,))
    num_rows, num_cols = x.shape
    if sorted(order_bits) != list(range(len(order_bits))) or num_cols % (1 << len(order_bits)):
        raise ValueError(f"order_bits: expected a permutation of range(n) with 2^n dividing K = {num_cols}, "
                         f"got {order_bits}")
    x16 = torch.empty((num_rows, num_cols), dtype=torch.float16, device=x.device)
    unlift = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        block = next_pow2(num_cols)
        _lift_rows_kernel[(num_rows,)](x, x16, unlift, num_cols, *x.stride(), x16.stride(0), BLOCK=block,
                                       ORDER_BITS=tuple(order_bits), num_warps=4 if block <= 2048 else 8)
    return x16, unlift
