"""The Gumbel-max draw of one token a row, and the counter-based noise it is keyed by.

The noise for row i and vocab entry v is a hash of (seeds[i], positions[i], v): a
row's token depends only on its own logits, temperature, seed and position, so
the op is row-local (batch-invariant in every table). `mla_func.serving.sampling` builds
top-k, top-p and the request-level settings on top of `gumbel_max`.
"""

from __future__ import annotations

import torch

from ..checks import as_dtype, check_dtype, check_same_device, check_shape

# Below this, a temperature is treated as 0 (greedy): float32 has no headroom to
# divide logits by it, and the distribution it asks for is the argmax anyway.
MIN_TEMPERATURE = 1e-5

# splitmix64's constants as unsigned 64-bit values (the Triton kernel's arithmetic).
GAMMA = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
# The noise keeps the top NOISE_BITS bits of a hash: 23, so (bits + 0.5) / 2**23 stays below 1 in float32.
NOISE_BITS = 23


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


# torch int64 arithmetic wraps modulo 2**64, so signed multiplies and adds with
# these give the same bits as the unsigned ones the mix is defined with.
_GAMMA = _i64(GAMMA)
_M1 = _i64(M1)
_M2 = _i64(M2)
_U23 = 1 << NOISE_BITS


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the sign copies makes it logical.
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection of 64-bit values that spreads every input bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1) keyed by (seed, position, vocab index).

    seeds [N] int64, positions [N] int64 -> [N, vocab_size] float32.
    Row key k = mix(mix(seed + G) ^ position); entry v is the top 23 bits of
    mix(k + (v + 1) * G), i.e. the v-th output of a splitmix64 stream seeded
    with k, mapped to (b + 0.5) / 2**23 (23 bits so the value stays below 1 in
    float32).
    """
    key = _mix64(_mix64(seeds + _GAMMA) ^ positions)  # [N]
    counter = (torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GAMMA)  # [V]
    bits = _shr(_mix64(key[:, None] + counter[None, :]), 64 - NOISE_BITS)  # [N, V]
    return (bits.to(torch.float32) + 0.5) * (1.0 / _U23)


def check_gumbel_max_args(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                          positions: torch.Tensor) -> None:
    """Raise ValueError unless the arguments fit the `GumbelMax` contract (shared by every backend)."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape (N, V), got {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits: expected a vocabulary of at least one entry, got V = 0")
    check_dtype("logits", logits, (torch.float32, torch.bfloat16, torch.float16))
    for name, tensor in (("temperature", temperature), ("seeds", seeds), ("positions", positions)):
        check_shape(name, tensor, (num_rows,))
    check_dtype("temperature", temperature, (torch.float32,))
    check_dtype("seeds", seeds, (torch.int64,))
    check_dtype("positions", positions, (torch.int64,))
    check_same_device(logits=logits, temperature=temperature, seeds=seeds, positions=positions)


def gumbel_max(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """One token a row: argmax of the raw logits where temperature < MIN_TEMPERATURE, else the
    Gumbel-max draw argmax_v(logits[v] / T + g[v]), g = -log(-log(uniform_noise(seed, position, v))),
    which samples softmax(logits / T).

    logits [N, V] float32, bfloat16 or float16 (computed in float32); temperature [N] float32;
    seeds, positions [N] int64 -> [N] int64; ties go to the lowest index (and a NaN wins), as
    `torch.argmax`.
    """
    check_gumbel_max_args(logits, temperature, seeds, positions)
    logits = as_dtype(logits, torch.float32)
    greedy = temperature < MIN_TEMPERATURE  # [N]
    # Greedy rows are divided by 1 so they stay finite; their draw is discarded below.
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]  # [N, V]
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, logits.shape[1])))  # [N, V]
    drawn = (scaled + gumbel).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
