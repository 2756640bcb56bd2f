"""Activations to FP8 per token and group of columns (the "dynamic" scheme): `reference.fp8.quantize_activations`.

Bit for bit the reference's: the scale is max(|x|, floor) / 448 (for "ue8m0" scales, the power of two at or
above max(|x|, 1e-4) times 1/448, by its bits) and x / scale is an IEEE division (`div_rn`; `/` is an
approximate division on NVIDIA GPUs), and the rounding to e4m3 is done in
float32 arithmetic (`round_to_e4m3`) before the cast, which is then exact. The explicit rounding is
there for Triton's CPU interpreter, whose float32 -> float8 cast drops the carry out of the mantissa
(31.1 becomes 16, not 32); on a GPU it costs a few integer operations a value of a memory-bound pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_shape
from ..reference.fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, UE8M0_AMAX_FLOOR, check_scale_fmt
from ._common import check_float, next_pow2, pdl

# Kernels read module globals only as constexprs.
_FMAX = tl.constexpr(FP8_MAX)
_AMAX_MIN = tl.constexpr(AMAX_FLOOR)
_UE8M0_AMAX_MIN = tl.constexpr(UE8M0_AMAX_FLOOR)
_INV_FMAX = tl.constexpr(1.0 / FP8_MAX)
# Groups a program quantizes: enough columns a program to keep loads wide, few enough programs
# for short rows.
_GROUPS_PER_PROGRAM = 4


@triton.jit
def round_to_e4m3(v):
    """v float32 in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still as float32.

    A value of binary exponent e (at least -6, e4m3's smallest normal one) keeps 3 fraction bits,
    so it is a whole multiple of 2^(e-3): scaling by a power of two is exact and adding and
    subtracting 1.5 * 2^23 rounds to a whole number, ties to even.
    """
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(v) * inverse + 12582912.0) - 12582912.0) * quantum
    # The sign is put back by its bit, so that -0.0 stays -0.0 as torch's cast keeps it.
    return (magnitude.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(x, UE8M0: tl.constexpr):
    """x [R, G] float32, one group a row -> (values [R, G] float8_e4m3fn, scales [R] float32): the reference's
    `scale_fmt` "ue8m0" where UE8M0, else "fp32"."""
    amax = tl.max(tl.abs(x), axis=1)
    if UE8M0:
        scale = tl.maximum(amax, _UE8M0_AMAX_MIN) * _INV_FMAX
        # Up to a power of two: a mantissa that is not zero carries into the exponent (NaN stays NaN).
        power = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale == scale, power, scale)
    else:
        scale = tl.math.div_rn(tl.maximum(amax, _AMAX_MIN), _FMAX)
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -_FMAX), _FMAX)
    return round_to_e4m3(scaled).to(tl.float8e4nv), scale


# The row count follows the step's batch: a plain argument, not one compile per count.
@triton.jit(do_not_specialize=["num_rows"])
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr,
    num_rows, k_in,
    s_xt, s_xk, s_qt, s_st, s_sg,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, UE8M0: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ks = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    k_mask = ks < k_in
    x = tl.load(x_ptr + row * s_xt + ks * s_xk, mask=k_mask, other=0.0).to(tl.float32)
    values, scales = quantize_tile(x, UE8M0)
    tl.store(q_ptr + row * s_qt + ks, values, mask=k_mask)
    tl.store(s_ptr + row * s_st + groups * s_sg, scales, mask=groups * GROUP < k_in)


def quantize_activations(x: torch.Tensor, group: int = 128, *, scales_by_group: bool = True,
                         scale_fmt: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.fp8.quantize_activations`: x [T, K] (any strides) ->
    (x_fp8 [T, K] float8_e4m3fn, contiguous; scales [T, ceil(K / group)] float32).

    group: a power of two. With `scales_by_group` the scales are stored group-major ([kb, T]
    in memory, returned as its transposed view), so that a GEMM tile's scales for one K block
    are one contiguous read; otherwise token-major.
    """
    if x.ndim != 2:
        raise ValueError(f"x: expected [T, K], got shape {tuple(x.shape)}")
    check_float("x", x)
    check_scale_fmt(scale_fmt)
    if group < 1 or group != next_pow2(group):
        raise ValueError(f"group: expected a power of two, got {group}")
    num_rows, k_in = x.shape
    num_groups = triton.cdiv(k_in, group)
    x_fp8 = torch.empty((num_rows, k_in), dtype=FP8_DTYPE, device=x.device)
    if scales_by_group:
        scales = torch.empty((num_groups, num_rows), dtype=torch.float32, device=x.device).T
    else:
        scales = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
    check_shape("scales", scales, (num_rows, num_groups))
    if num_rows == 0 or k_in == 0:
        return x_fp8, scales
    groups = min(_GROUPS_PER_PROGRAM, next_pow2(num_groups))
    use_pdl = pdl(x.device)
    _quantize_kernel[(num_rows, triton.cdiv(num_groups, groups))](
        x, x_fp8, scales,
        num_rows, k_in,
        *x.stride(), x_fp8.stride(0), *scales.stride(),
        GROUP=group, GROUPS=groups, UE8M0=scale_fmt == "ue8m0", GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
    return x_fp8, scales
