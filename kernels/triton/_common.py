"""Helpers shared by the Triton op wrappers (launch geometry, dtype rules) and by their kernels."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..checks import check_dtype

# Attention kernels run their softmax in base 2 (exp2 and log2 are the hardware's):
# the host scales scores by LOG2E, and a kernel turns a base-2 LSE back into the
# natural log the contracts speak by multiplying with LN2.
LN2 = tl.constexpr(math.log(2.0))
LOG2E = 1.0 / math.log(2.0)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Each of them as a kernel argument (a dtype a kernel rounds to).
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def power_of_two_scale(amax, EXPONENT: tl.constexpr):
    """(2^s, 2^-s) with amax * 2^s in [2^EXPONENT, 2^(EXPONENT + 1)), elementwise; zero and subnormal maxima,
    infinities and NaN keep s = 0, and s is clamped so that both powers are normal float32 numbers."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    shift = tl.where((biased == 0) | (biased == 0xFF), 0, EXPONENT + 127 - biased)
    shift = tl.minimum(tl.maximum(shift, -126), 126)
    scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    unscale = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return scale, unscale


@triton.jit
def online_softmax_weights(scores, m_i, l_i):
    """One tile of a base-2 online softmax: scores [M, N] (scaled by LOG2E, -inf where masked) against
    the running maximum m_i [M] and sum l_i [M] -> (new maximum, new sum, alpha [M] to rescale the
    running output by, weights p [M, N] float32)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A tile (or a whole split) may hold no valid key: while the maximum is
    # still -inf, shift by 0 so every weight is exp2(-inf) = 0, never NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(scores - shift[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def online_softmax_fold(scores, values, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """`online_softmax_weights`, then values [N, D] folded into the output acc [M, D] float32."""
    m_new, l_i, alpha, p = online_softmax_weights(scores, m_i, l_i)
    acc = tl.dot(p.to(values.dtype), values, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Under TRITON_INTERPRET=1 (CPU tests) there is no device to size a grid for; a
# small fixed count keeps the interpreted grids short while still giving
# split-KV several splits to reduce.
_INTERPRETER_SM_COUNT = 4


def sm_count(device: torch.device) -> int:
    """Multiprocessor count of `device`: the one hardware fact grid sizes may depend on."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SM_COUNT


def h200(device: torch.device) -> bool:
    """Whether `device` is an NVIDIA H200: an H100's multiprocessors behind 4.8 TB/s of memory (3.35 on the
    H100), so that streaming kernels need more bytes in flight a program; the tiles measured apart on it
    (`fp8_linear.row_tiles`, `fp8_moe.fp8_moe_config`, `fp8_moe_pairs.fp8_pair_config`) ask this."""
    return device.type == "cuda" and "H200" in torch.cuda.get_device_name(device)


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents of the kernel before them.

    On Hopper and later NVIDIA GPUs a kernel launched with `launch_pdl=True` may be
    scheduled while the previous kernel of the stream is still running; it must
    pass `gdc_wait()` before it reads anything an earlier kernel wrote or writes
    anything at all. What it loads before the wait (weights) overlaps the previous
    kernel's tail, and a chain of small decode kernels loses most of its launch gaps.
    The kernels take the answer as their GDC constexpr.
    """
    return device.type == "cuda" and _pdl_capable(device.index if device.index is not None else
                                                  torch.cuda.current_device())


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise be multiplied in TF32 (10-bit mantissa) on
    # tensor cores; float32 callers (tests, oracles) expect float32 products.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_float(name: str, tensor: torch.Tensor) -> None:
    check_dtype(name, tensor, FLOAT_DTYPES)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
