"""The Gumbel-max draw of one token a row in one launch: noise, scaling and argmax fused.

The reference (`reference.sampling.gumbel_max`) builds the [N, V] noise with ~30
small torch ops; here one program a row hashes each vocab entry's noise as it
reads the logits, keeping a running maximum and its index, so nothing [N, V] is
written and the host issues one launch. The result is bit for bit the
reference's: the same unsigned 64-bit hash (wrap-around multiplies, logical
shifts), the division rounded to nearest (`div_rn`, not the approximate `/`),
CUDA's `logf` (libdevice, as torch's log) and no fused multiply-adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..reference.sampling import GAMMA, M1, M2, MIN_TEMPERATURE, NOISE_BITS, check_gumbel_max_args

_GAMMA = tl.constexpr(GAMMA)
_M1 = tl.constexpr(M1)
_M2 = tl.constexpr(M2)
_NOISE_SHIFT = tl.constexpr(64 - NOISE_BITS)
_NOISE_SCALE = tl.constexpr(1.0 / (1 << NOISE_BITS))
_MIN_TEMPERATURE = tl.constexpr(MIN_TEMPERATURE)

# Vocab entries a program reads per iteration, and its warps. A row is one program, so for
# few rows the latency of one program's loop is the op's time: on an H100 (bf16, V = 129280,
# back-to-back calls timed by CUDA events) 16 warps over blocks of 4096 took ~97 us for 1 to 64
# rows and ~172 us for 256, against ~124 / ~194 us for 8 warps over 2048.
_BLOCK_V = 4096
_NUM_WARPS = 16
# The interpreter runs a block as numpy arrays; a smaller one keeps the CPU tests' short rows
# covering several blocks and a partial last one.
_INTERPRETER_BLOCK_V = 64


@triton.jit
def _mix64(x):
    """splitmix64's finaliser on uint64 values (`reference.sampling._mix64`)."""
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    return x ^ (x >> 31)


@triton.jit
def _noise(key, cols):
    """uniform_noise of vocab entries cols [BLOCK] int32 under the row key (uint64) -> [BLOCK] float32."""
    counter = (cols + 1).to(tl.uint64) * _GAMMA
    bits = _mix64(key + counter) >> _NOISE_SHIFT
    return (bits.to(tl.float32) + 0.5) * _NOISE_SCALE


@triton.jit
def _fold(best, best_idx, best_nan, vals, cols, mask):
    """Fold one block into the running argmax, as `torch.argmax` orders values: a NaN beats every
    number, equal values go to the lower index (blocks come in index order, so the running one)."""
    is_nan = (vals != vals) & mask
    block_nan = tl.max(is_nan.to(tl.int32), axis=0)
    clean = tl.where(mask & (vals == vals), vals, float("-inf"))
    block_max = tl.max(clean, axis=0)
    candidate = tl.where(block_nan > 0, is_nan, mask & (clean == block_max))
    block_idx = tl.min(tl.where(candidate, cols, 2147483647), axis=0)
    take = (best_nan == 0) & ((block_nan > 0) | (block_max > best))
    best = tl.where(take, block_max, best)
    best_idx = tl.where(take, block_idx, best_idx)
    best_nan = tl.maximum(best_nan, block_nan)
    return best, best_idx, best_nan


# What a launch computes: the draw, or for tests one of its [N, V] intermediates.
_DRAW = tl.constexpr(0)
_NOISE = tl.constexpr(1)
_SCORES = tl.constexpr(2)


@triton.jit
def _gumbel_max_kernel(
    logits_ptr, temperature_ptr, seeds_ptr, positions_ptr, out_ptr, values_ptr,
    vocab, stride_n, stride_v, stride_t, stride_s, stride_p, stride_values,
    MODE: tl.constexpr,
    LIBDEVICE_LOG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row * stride_t)
    seed = tl.load(seeds_ptr + row * stride_s).to(tl.uint64, bitcast=True)
    position = tl.load(positions_ptr + row * stride_p).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed + _GAMMA) ^ position)
    # As the reference decides: a NaN temperature is not greedy (and its row's draw is NaN, so index 0).
    greedy = temperature < _MIN_TEMPERATURE
    offsets = tl.arange(0, BLOCK_V)
    best = float("-inf")
    best_idx = 0
    best_nan = 0
    row_logits = logits_ptr + row * stride_n
    for start in range(0, vocab, BLOCK_V):
        cols = start + offsets
        mask = cols < vocab
        if MODE == _NOISE:
            tl.store(values_ptr + row * stride_values + cols, _noise(key, cols), mask=mask)
        else:
            vals = tl.load(row_logits + cols * stride_v, mask=mask, other=0.0).to(tl.float32)
            if not greedy:
                u = _noise(key, cols)
                if LIBDEVICE_LOG:
                    gumbel = -libdevice.log(-libdevice.log(u))
                else:
                    # The interpreter has no libdevice; its log is numpy's.
                    gumbel = -tl.log(-tl.log(u))
                vals = tl.math.div_rn(vals, temperature) + gumbel
            if MODE == _SCORES:
                tl.store(values_ptr + row * stride_values + cols, vals, mask=mask)
            else:
                best, best_idx, best_nan = _fold(best, best_idx, best_nan, vals, cols, mask)
    if MODE == _DRAW:
        tl.store(out_ptr + row, best_idx)  # widened to the int64 output on store


def _launch(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
            out: torch.Tensor, values: torch.Tensor, *, mode: tl.constexpr) -> None:
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    on_gpu = logits.device.type == "cuda"
    _gumbel_max_kernel[(num_rows,)](
        logits, temperature, seeds, positions, out, values,
        vocab, logits.stride(0), logits.stride(1), temperature.stride(0), seeds.stride(0), positions.stride(0),
        values.stride(0),
        MODE=mode,
        LIBDEVICE_LOG=on_gpu,
        BLOCK_V=_BLOCK_V if on_gpu else _INTERPRETER_BLOCK_V,
        num_warps=_NUM_WARPS,
        # A fused multiply-add would round the scaled logit and the noise once where torch rounds twice.
        enable_fp_fusion=False,
    )


def gumbel_max(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """Contract of `reference.sampling.gumbel_max`, one program a row over the vocabulary in blocks.

    logits [N, V] float32, bfloat16 or float16 (any strides; computed in float32); temperature [N]
    float32 (< MIN_TEMPERATURE: greedy); seeds, positions [N] int64 -> tokens [N] int64.
    """
    check_gumbel_max_args(logits, temperature, seeds, positions)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    # The draw writes no [N, V] values; any tensor stands in for their pointer.
    _launch(logits, temperature, seeds, positions, out, out[:, None], mode=_DRAW)
    return out


def scores(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """What `gumbel_max` takes the argmax of, for tests: logits [N, V] as float32 for a greedy row,
    logits / T + g for a sampled one -> [N, V] float32 (arguments as `gumbel_max`)."""
    check_gumbel_max_args(logits, temperature, seeds, positions)
    values = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _launch(logits, temperature, seeds, positions, values[:, 0].long(), values, mode=_SCORES)
    return values


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernel's noise alone, for tests: `reference.sampling.uniform_noise` computed by the kernel.

    seeds, positions [N] int64 -> [N, vocab_size] float32.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size: expected >= 1, got {vocab_size}")
    num_rows = seeds.shape[0]
    values = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=seeds.device)
    temperature = torch.ones(num_rows, device=seeds.device)
    check_gumbel_max_args(values, temperature, seeds, positions)
    _launch(values, temperature, seeds, positions, temperature.long(), values, mode=_NOISE)
    return values
