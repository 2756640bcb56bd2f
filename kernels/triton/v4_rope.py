"""DeepSeek-V4's partial rope (the trailing channels rotated by interleaved pairs) in one kernel.

The reference takes a dozen launches a call (slices, stacks, casts), and a V4
layer rotates its queries, its key, its indexer queries and, inversely, its output.
Here a program takes one token's BLOCK_M rows (heads) and writes each row whole:
each row read and written in one contiguous, vectorised access, split into (even,
odd) channels in registers, the pairs of the tail rotated by the token's angles in
float32, the rest copied.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_same_device, check_shape
from ._common import check_float, next_pow2, pdl

_BLOCK_M = 4
# Under the interpreter a program's cost is per operation, not per value: a token's rows in one program.
_INTERPRETER_BLOCK_M = 64


@triton.jit(do_not_specialize=["rows"])
def _rope_tail_kernel(
    x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr,
    rows, sign, eps,
    s_xt, s_xm, s_xd, s_ct, s_cd, s_st, s_sd, s_ot, s_om, s_od,
    PAIRS: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, UNIT_RMS: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    # The angles' row: the token's position in the tables, or the token itself.
    angle_row = tl.load(pos_ptr + t).to(tl.int64) if HAS_POSITIONS else t
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.arange(0, BLOCK_P)
    p_mask = pairs < PAIRS
    angle = pairs - (PAIRS - ROPE_PAIRS)
    is_pe = (angle >= 0) & p_mask
    cos = tl.load(cos_ptr + angle_row * s_ct + angle * s_cd, mask=is_pe, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + angle_row * s_st + angle * s_sd, mask=is_pe, other=0.0).to(tl.float32) * sign
    # Whole rows in one contiguous load (vectorised), split into (even, odd) channels in registers:
    # two loads of every other channel each moved two bytes a lane.
    channels = tl.arange(0, 2 * BLOCK_P)
    mask = (ms < rows)[:, None] & (channels < 2 * PAIRS)[None, :]
    src = x_ptr + t * s_xt + ms[:, None] * s_xm
    x = tl.load(src + channels[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
    even, odd = tl.split(x.reshape(BLOCK_M, BLOCK_P, 2))
    if UNIT_RMS:
        # `unit_rms` first, rounded as it rounds: the scale to x's dtype, then each product.
        dtype = x_ptr.dtype.element_ty
        mean_sq = (tl.sum(even * even, axis=1) + tl.sum(odd * odd, axis=1)) / (2 * PAIRS)
        scale = (1.0 / tl.sqrt(mean_sq + eps)).to(dtype).to(tl.float32)[:, None]
        even = (even * scale).to(dtype).to(tl.float32)
        odd = (odd * scale).to(dtype).to(tl.float32)
    rot_even = tl.where(is_pe[None, :], even * cos[None, :] - odd * sin[None, :], even)
    rot_odd = tl.where(is_pe[None, :], odd * cos[None, :] + even * sin[None, :], odd)
    out = tl.join(rot_even, rot_odd).reshape(BLOCK_M, 2 * BLOCK_P)
    dst = out_ptr + t * s_ot + ms[:, None] * s_om
    tl.store(dst + channels[None, :] * s_od, out.to(out_ptr.dtype.element_ty), mask=mask)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, positions: torch.Tensor | None = None,
              unit_rms_eps: float | None = None, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing R channels of x [T, ..., D] by interleaved pairs (see `reference.v4_attention.rope_tail`).

    cos, sin: [T, 1, ..., R / 2] or [T, R / 2]: one angle per token and pair, shared by x's middle dims
    (the layouts the model passes); or, with positions [T] (integers), tables [P, R / 2] read at row
    positions[t] for token t, in the kernel (no gathered copy). With unit_rms_eps each row of D is
    first scaled to unit RMS (`unit_rms`, fused: one launch for V4's queries). D and R even. Returns a
    new tensor in x's dtype.
    """
    check_float("x", x)
    check_same_device(x=x, cos=cos, sin=sin)
    if x.dim() < 2:
        raise ValueError(f"x: expected [T, ..., D], got shape {tuple(x.shape)}")
    num_tokens, dim = x.shape[0], x.shape[-1]
    half = cos.shape[-1]
    if positions is not None:
        check_same_device(x=x, positions=positions)
        check_shape("positions", positions, (num_tokens,))
        if positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions: expected int32 or int64, got {positions.dtype}")
        if tuple(sin.shape) != tuple(cos.shape) or cos.dim() != 2:
            raise ValueError(f"cos, sin: expected tables [P, R / 2] with positions, got {tuple(cos.shape)} and "
                             f"{tuple(sin.shape)}")
    elif tuple(sin.shape) != tuple(cos.shape) or cos.shape[0] != num_tokens or any(s != 1 for s in cos.shape[1:-1]):
        raise ValueError(f"cos, sin: expected [{num_tokens}, 1, ..., R / 2] or [{num_tokens}, R / 2] sharing one angle "
                         f"per token, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if dim % 2 or 2 * half > dim:
        raise ValueError(f"x: expected an even last dim with room for {2 * half} rotated channels, got {dim}")
    x3 = x.reshape(num_tokens, math.prod(x.shape[1:-1]), dim)    # (not -1: zero tokens leave it ambiguous)
    cos2, sin2 = cos.reshape(-1, half), sin.reshape(-1, half)
    out = torch.empty_like(x3)
    rows = x3.shape[1]
    if num_tokens == 0 or rows == 0:
        return out.view(x.shape)
    block_m = _BLOCK_M if x.device.type == "cuda" else max(_BLOCK_M, min(_INTERPRETER_BLOCK_M, next_pow2(rows)))
    _rope_tail_kernel[(num_tokens, triton.cdiv(rows, block_m))](
        x3, cos2, sin2, cos2 if positions is None else positions, out,
        rows, -1.0 if inverse else 1.0, 0.0 if unit_rms_eps is None else float(unit_rms_eps),
        *x3.stride(), *cos2.stride(), *sin2.stride(), *out.stride(),
        PAIRS=dim // 2, ROPE_PAIRS=half, BLOCK_P=max(16, next_pow2(dim // 2)), BLOCK_M=block_m,
        HAS_POSITIONS=positions is not None, UNIT_RMS=unit_rms_eps is not None, GDC=pdl(x.device), num_warps=4, launch_pdl=pdl(x.device),
    )
    return out.view(x.shape)
