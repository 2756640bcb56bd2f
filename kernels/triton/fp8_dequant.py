"""A block-scaled FP8 weight dequantized in one pass: the dense weight for products at prefill sizes.

`BlockFP8Weight.dequantize` (the reference's definition: values * scale_inv per block, in float32, rounded
once to the target dtype) as one kernel: each program reads a [TILE_N, TILE_K] tile of values (one byte a
value) and the scales of the blocks it covers, and writes the products rounded to the target dtype (two
bytes a value for bf16): three bytes of traffic a value, where torch's expression makes four float32
passes. The result is the reference's bit for bit (an e4m3 value is exact in float32; one float32
product, one rounding).

Why a dense copy at all: from a few hundred rows on, a product of FP8 weights by 16-bit activations is
bound by widening every FP8 tile for every tile of rows (`fp8_linear`'s block GEMM took 2.7-3.1x cuBLAS's
time on the dense weight at 8192 rows on an H200), while a dense bf16 weight meets cuBLAS at its full rate and costs
one pass over the weight, shared by all the rows (`fp8_ops`, `FP8_DEQUANTIZE_ROWS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_dtype
from ..quantized import FP8_DTYPE, BlockFP8Weight
from ._common import FLOAT_DTYPES

_TILE_N, _TILE_K = 32, 128


@triton.jit
def _dequantize_kernel(v_ptr, s_ptr, out_ptr, N, K, s_ve, s_vn, s_vk, s_se, s_sn, s_sk, s_oe, s_on, s_ok,
                       BN: tl.constexpr, BK: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr):
    e = tl.program_id(2)
    rows = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    cols = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    v = tl.load(v_ptr + e * s_ve + rows[:, None] * s_vn + cols[None, :] * s_vk, mask=mask, other=0.0)
    s = tl.load(s_ptr + e * s_se + (rows // BN)[:, None] * s_sn + (cols // BK)[None, :] * s_sk, mask=mask,
                other=0.0)
    w = v.to(tl.float32) * s
    tl.store(out_ptr + e * s_oe + rows[:, None] * s_on + cols[None, :] * s_ok, w.to(out_ptr.dtype.element_ty),
             mask=mask)


def fp8_dequantize(weight: BlockFP8Weight, dtype: torch.dtype) -> torch.Tensor:
    """weight [..., N, K] (values float8_e4m3fn, scale_inv per (bn, bk) block) -> [..., N, K] in `dtype`
    (bf16, fp16 or float32), contiguous: `weight.dequantize(dtype)`'s bits."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"fp8_dequantize: dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    check_dtype("values", weight.values, (FP8_DTYPE,))
    *lead, n, k = weight.shape
    values = weight.values.reshape(-1, n, k)
    scales = weight.scale_inv.reshape(-1, *weight.scale_inv.shape[-2:])
    out = torch.empty((values.shape[0], n, k), dtype=dtype, device=values.device)
    if out.numel():
        grid = (triton.cdiv(n, _TILE_N), triton.cdiv(k, _TILE_K), values.shape[0])
        _dequantize_kernel[grid](values, scales, out, n, k, *values.stride(), *scales.stride(), *out.stride(),
                                 BN=weight.block[0], BK=weight.block[1], TILE_N=_TILE_N, TILE_K=_TILE_K)
    return out.view(*lead, n, k)
