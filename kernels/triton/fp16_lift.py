"""bf16 tiles lifted to fp16 exactly, so that FP8 weight tiles meet them as fp16.

Hopper widens e4m3 to fp16 in one instruction for two values (`cvt.rn.f16x2.e4m3x2`); to bf16 it
takes that and one more conversion a value. A product of a widened FP8 tile and a bf16 tile is
therefore cheaper as fp16 x fp16 (same tensor-core rate, float32 accumulation) when the bf16 tile
can be written in fp16 without loss: each line of the tile (a row of activations) is multiplied by
the power of two that puts its largest magnitude in [2^14, 2^15). A bf16 value has 8 significant
bits, so every value of the line above 2^-31 times its largest is then exact in fp16 (smaller ones
round on fp16's subnormal grid, below 2^-39 of the line's largest); the power of two is undone on
the float32 product, exactly. Used by the FP8 weight stream (`fp8_linear`), which takes its rows
lifted by `lift_rows` before it: done in the stream's loop, every program would lift the same rows
again at every K step, and the lifted tile would go from registers back to shared memory for the
tensor cores, where a tile read from memory is copied there directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl

# Groups a program lifts: enough columns a program to keep loads wide, few enough programs for short rows.
_GROUPS_PER_PROGRAM = 4


@triton.jit
def lift_to_fp16(x, AXIS: tl.constexpr):
    """x [A, B] (bf16) -> (x16 [A, B] fp16, unscale) with x == x16 * unscale along each line.

    A line runs along AXIS (AXIS 1: each row is a line, unscale [A]; AXIS 0: each column, unscale
    [B]). A line of zeros keeps unscale 1; infinities and NaN pass through as they are.
    """
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=AXIS)
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # 2^shift puts amax in [2^14, 2^15): shift = 14 - (biased - 127). Clamped so that both 2^shift and
    # 2^-shift are normal float32 numbers; zero and subnormal maxima (biased 0) stay unscaled.
    shift = tl.where(biased == 0, 0, 141 - biased)
    shift = tl.minimum(tl.maximum(shift, -126), 126)
    scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    unscale = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    x16 = (xf * tl.expand_dims(scale, AXIS)).to(tl.float16)
    return x16, unscale


# The row count follows the step's batch: a plain argument, not one compile per count.
@triton.jit(do_not_specialize=["num_rows"])
def _lift_rows_kernel(
    x_ptr, x16_ptr, u_ptr,
    num_rows, k_in,
    s_xt, s_xk, s_x16t, s_ut, s_ug,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ks = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    k_mask = ks < k_in
    x16, unscale = lift_to_fp16(tl.load(x_ptr + row * s_xt + ks * s_xk, mask=k_mask, other=0.0), 1)
    tl.store(x16_ptr + row * s_x16t + ks, x16, mask=k_mask)
    tl.store(u_ptr + row * s_ut + groups * s_ug, unscale, mask=groups * GROUP < k_in)


def lift_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] bf16 (any strides) -> (x16 [T, K] fp16, contiguous; unscale [T, ceil(K / group)] float32)
    with x == x16 * unscale[:, k // group] (`lift_to_fp16` on each group of a row; exact down to 2^-31 of
    the group's largest). group: a power of two. unscale is stored group-major ([kb, T] in memory, returned
    as its transposed view), so that the scales of one K block are one contiguous read, as
    `fp8_quant.quantize_activations` stores its scales."""
    if x.ndim != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected a [T, K] bfloat16 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if group < 1 or group != next_pow2(group):
        raise ValueError(f"group: expected a power of two, got {group}")
    num_rows, k_in = x.shape
    num_groups = triton.cdiv(k_in, group)
    x16 = torch.empty((num_rows, k_in), dtype=torch.float16, device=x.device)
    unscale = torch.empty((num_groups, num_rows), dtype=torch.float32, device=x.device).T
    if num_rows == 0 or k_in == 0:
        return x16, unscale
    groups = min(_GROUPS_PER_PROGRAM, next_pow2(num_groups))
    use_pdl = pdl(x.device)
    _lift_rows_kernel[(num_rows, triton.cdiv(num_groups, groups))](
        x, x16, unscale,
        num_rows, k_in,
        *x.stride(), x16.stride(0), *unscale.stride(),
        GROUP=group, GROUPS=groups, GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
    return x16, unscale
