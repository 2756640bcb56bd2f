"""DeepSeek-V4's unweighted RMS norm (queries per head, hyper-connection streams) in one kernel.

One program per row, two passes over it in BLOCK_D chunks (sum of squares in float32,
then the scale), so rows as wide as the flattened streams (hc_mult x hidden size)
need no more registers than a head. The scale is rounded to x's dtype before it
multiplies x, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import check_float, next_pow2, pdl

_MAX_BLOCK_D = 2048


@triton.jit
def _unit_rms_kernel(x_ptr, out_ptr, dim, eps, s_xr, s_xd, s_or, s_od, BLOCK_D: tl.constexpr, GDC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK_D)
    total = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + offs
        v = tl.load(x_ptr + r * s_xr + d * s_xd, mask=d < dim, other=0.0).to(tl.float32)
        total += v * v
    scale = (1.0 / tl.sqrt(tl.sum(total, axis=0) / dim + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + offs
        v = tl.load(x_ptr + r * s_xr + d * s_xd, mask=d < dim, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * s_or + d * s_od, (v * scale).to(out_ptr.dtype.element_ty), mask=d < dim)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim of x [..., D] (no weight) -> a new tensor in x's dtype."""
    check_float("x", x)
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    out = torch.empty_like(x2)
    if x2.shape[0] == 0 or dim == 0:
        return out.view(x.shape)
    _unit_rms_kernel[(x2.shape[0],)](
        x2, out, dim, eps, *x2.stride(), *out.stride(),
        BLOCK_D=min(_MAX_BLOCK_D, max(16, next_pow2(dim))), GDC=pdl(x.device), num_warps=4,
        launch_pdl=pdl(x.device),
    )
    return out.view(x.shape)
