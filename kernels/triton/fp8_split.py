"""bf16 tiles written as the sum of two e4m3 tiles, so that FP8 weight tiles meet them on FP8 tensor cores.

A product of a widened FP8 weight tile and a bf16 tile spends its time widening: at 16 rows the FP8
weight stream read 79% of the copy rate on an H200 over a weight too large for any tail (and 99.9%
when the rows were FP8 too, w8a8). The rows can be FP8 without changing the product's value: a bf16
value has 8 significant bits and e4m3 has 4, so each line of the tile (a row of activations) is
written as hi * 2^a + lo * 2^b, hi the line times a power of two (its largest magnitude in [2^7, 2^8),
below e4m3's 448) cut toward zero to e4m3's 4 significant bits, lo what hi left out, times its own power
of two. The remainder is the value's last 4 bits, so lo holds it exactly; only values more than about
2^12 below the line's largest (where hi, then lo, fall to e4m3's subnormals) lose bits, at most 2^-18 of
the line's largest.
The product is then two FP8 products into float32, each times its power of two (undone exactly).

`split_rows` writes both parts of every row once, per group of columns (a K block of the weight's
scales), before the product: the weight stream then runs its w8a8 loop twice over, and no program
widens a weight tile or splits a row tile of its own (done inside the stream's loop, a program per
column tile and K step, the split cost 1.4x the widened stream's time on an H200). Used by the FP8
weight stream (`fp8_linear`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..reference.fp8 import FP8_DTYPE
from ._common import next_pow2, pdl, power_of_two_scale


@triton.jit
def _truncate_to_e4m3(v):
    """v float32 (|v| < 448) -> v toward zero to a float8_e4m3fn value, still as float32: 4 significant bits,
    and a whole multiple of 2^-9 (e4m3's subnormal step) below 2^-6."""
    normal = (v.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (v * 512.0).to(tl.int32).to(tl.float32) * 0.001953125
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def split_to_fp8(x, AXIS: tl.constexpr):
    """x [A, B] (bf16) -> (hi, hi_unscale, lo, lo_unscale): hi, lo [A, B] e4m3 with
    x == hi * hi_unscale + lo * lo_unscale along each line (see the module docstring for the rounding of
    values far below a line's largest).

    A line runs along AXIS (AXIS 0: each column is a line, the unscales [B]; AXIS 1: each row, [A]).
    A line of zeros gives zeros; a line holding a NaN or an infinity gets a NaN hi_unscale, so its
    products are NaN.
    """
    xf = x.to(tl.float32)
    finite = tl.abs(xf) < float("inf")
    xf = tl.where(finite, xf, 0.0)
    scale, unscale = power_of_two_scale(tl.max(tl.abs(xf), axis=AXIS), 7)
    # A line with a NaN or an infinity gets a NaN unscale: FP8 has no infinity, and a NaN cast to it
    # need not stay NaN on every backend.
    broken = tl.sum((~finite).to(tl.int32), axis=AXIS) > 0
    unscale = tl.where(broken, float("nan"), unscale)
    # hi keeps the top 4 bits by truncation, in float32: the remainder is taken from that value, and the casts
    # convert values e4m3 holds exactly (the CPU interpreter's cast mis-rounds a carry out of the mantissa;
    # on an H200, Triton 3.6 widened the cast values back wrongly in some layouts).
    hi = _truncate_to_e4m3(xf * tl.expand_dims(scale, AXIS))
    rest = xf - hi * tl.expand_dims(tl.where(broken, 0.0, unscale), AXIS)
    rest_scale, rest_unscale = power_of_two_scale(tl.max(tl.abs(rest), axis=AXIS), 7)
    lo = _truncate_to_e4m3(rest * tl.expand_dims(rest_scale, AXIS))
    return hi.to(tl.float8e4nv), unscale, lo.to(tl.float8e4nv), rest_unscale


# The row count follows the step's batch: a plain argument, not one compile per count. One group of one row a
# program over one warp: H200, 16 rows of 7168, 1.6 us against 2.2 over four warps (several groups a program
# were no faster below 64 rows).
@triton.jit(do_not_specialize=["num_rows"])
def _split_rows_kernel(
    x_ptr, parts_ptr, u_ptr,
    num_rows, k_in,
    s_xt, s_xk, s_pp, s_pt, s_up, s_ug, s_ut,
    GROUP: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    ks = group * GROUP + tl.arange(0, GROUP)[None, :]
    k_mask = ks < k_in
    x = tl.load(x_ptr + row * s_xt + ks * s_xk, mask=k_mask, other=0.0)
    hi, hi_unscale, lo, lo_unscale = split_to_fp8(x, 1)
    tl.store(parts_ptr + row * s_pt + ks, hi, mask=k_mask)
    tl.store(parts_ptr + s_pp + row * s_pt + ks, lo, mask=k_mask)
    tl.store(u_ptr + group * s_ug + row * s_ut + tl.arange(0, 1), hi_unscale)
    tl.store(u_ptr + s_up + group * s_ug + row * s_ut + tl.arange(0, 1), lo_unscale)


def split_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] bf16 (any strides) -> (parts [2, T, K] float8_e4m3fn, contiguous; unscales [2, T, ceil(K / group)]
    float32, stored group-major) with x[t, k] == sum over p of parts[p, t, k] * unscales[p, t, k // group] (see the
    module docstring for values far below their group's largest).

    group: a power of two (the weight's scale block along K), so that a product's K step lies in one group.
    Group-major unscales make a K step's values for all rows one contiguous read.
    """
    if x.ndim != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected [T, K] bfloat16, got shape {tuple(x.shape)} {x.dtype}")
    if group < 1 or group != next_pow2(group):
        raise ValueError(f"group: expected a power of two, got {group}")
    num_rows, k_in = x.shape
    num_groups = triton.cdiv(k_in, group)
    parts = torch.empty((2, num_rows, k_in), dtype=FP8_DTYPE, device=x.device)
    unscales = torch.empty((2, num_groups, num_rows), dtype=torch.float32, device=x.device).transpose(1, 2)
    if num_rows == 0 or k_in == 0:
        return parts, unscales
    use_pdl = pdl(x.device)
    _split_rows_kernel[(num_rows, num_groups)](
        x, parts, unscales,
        num_rows, k_in,
        *x.stride(), parts.stride(0), parts.stride(1), unscales.stride(0), unscales.stride(2), unscales.stride(1),
        GROUP=group, GDC=use_pdl,
        num_warps=1, launch_pdl=use_pdl,
    )
    return parts, unscales
