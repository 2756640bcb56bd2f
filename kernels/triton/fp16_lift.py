"""bf16 tiles lifted to fp16 exactly, so that FP8 weight tiles meet them as fp16.

Hopper widens e4m3 to fp16 in one instruction for two values (`cvt.rn.f16x2.e4m3x2`); to bf16 it
takes that and one more conversion a value. A product of a widened FP8 tile and a bf16 tile is
therefore cheaper as fp16 x fp16 (same tensor-core rate, float32 accumulation) when the bf16 tile
can be written in fp16 without loss: each line of the tile (a row of activations) is multiplied by
the power of two that puts its largest magnitude in [2^14, 2^15). A bf16 value has 8 significant
bits, so every value of the line above 2^-31 times its largest is then exact in fp16 (smaller ones
round on fp16's subnormal grid, below 2^-39 of the line's largest); the power of two is undone on
the float32 product, exactly. Used by the FP8 weight stream (`fp8_linear`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import power_of_two_scale


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
