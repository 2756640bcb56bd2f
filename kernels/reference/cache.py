"""Writing per-token vectors into a paged cache: rows as they are, or latents quantized to FP8."""

from __future__ import annotations

from typing import overload

import torch

from ..checks import as_dtype, check_shape
from ..latent_cache import FP8_GROUP, FP8LatentCache, LatentCache
from .fp8 import quantize_activations


def write_rows(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rows: torch.Tensor,
    *,
    inplace: bool = True,
) -> torch.Tensor:
    """Write `rows` into the paged cache at `slot_mapping`.

    cache:        [num_blocks, block_size, D]
    slot_mapping: [T] integer, slot = block * block_size + offset; -1 marks padding
    rows:         [T, D] (cast to the cache's dtype)
    returns       the cache with the rows written: the same tensor when `inplace`,
                  a new one otherwise (the input is then left untouched, which is
                  what differentiation and branching need).

    Padding (-1) writes into slot 0 of block 0, the scratch block that the block
    allocator never hands out and no sequence reads, so that the write stays a
    single static-shape `index_copy` with no host sync.
    """
    num_blocks, block_size, dim = cache.shape
    check_shape("kv", rows, (slot_mapping.shape[0], dim))
    flat = cache.view(num_blocks * block_size, dim)
    slots = slot_mapping.clamp(min=0)
    if inplace:
        flat.index_copy_(0, slots, as_dtype(rows, cache.dtype))
        return cache
    return flat.index_copy(0, slots, rows.to(cache.dtype)).view(num_blocks, block_size, dim)


def quantize_latent(kv: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 cache's form of latent rows: kv [T, C + R] -> (values [T, C] float8_e4m3fn,
    scales [T, ceil(C / 128)] float32, rope [T, R] in kv's dtype).

    Per token and group of `FP8_GROUP` latent values (the last group partial): scale = the group's
    largest magnitude / 448 (e4m3's largest value; an all-zero group takes `fp8.AMAX_FLOOR` for its
    magnitude, so no division by zero), values = x / scale (IEEE division, widened to float32)
    rounded to the nearest e4m3, ties to even: `fp8.quantize_activations`' rounding exactly. The
    RoPE values are kept as they are.
    """
    values, scales = quantize_activations(kv[:, :kv_lora_rank], FP8_GROUP)
    return values, scales, kv[:, kv_lora_rank:]


def quantized_cache(dense: torch.Tensor, kv_lora_rank: int) -> FP8LatentCache:
    """A whole paged cache in FP8: dense [num_blocks, bs, C + R] -> the `FP8LatentCache` holding each of its
    rows as `write_kv` would (`quantize_latent`), the RoPE values in dense's dtype."""
    num_blocks, block_size, dim = dense.shape
    values, scales, rope = quantize_latent(dense.reshape(num_blocks * block_size, dim), kv_lora_rank)
    pages = (num_blocks, block_size)
    return FP8LatentCache(values=values.reshape(*pages, -1), scales=scales.reshape(*pages, -1),
                          rope=rope.reshape(*pages, -1))


def _write_fp8_latent(cache: FP8LatentCache, slot_mapping: torch.Tensor, kv: torch.Tensor, *,
                      inplace: bool) -> FP8LatentCache:
    check_shape("kv", kv, (slot_mapping.shape[0], cache.shape[2]))
    values, scales, rope = quantize_latent(kv, cache.kv_lora_rank)
    # The FP8 values move as their bytes: index_copy has no float8 kernel, and a byte copy keeps every bit.
    value_bytes = write_rows(cache.values.view(torch.uint8), slot_mapping, values.view(torch.uint8), inplace=inplace)
    scales = write_rows(cache.scales, slot_mapping, scales, inplace=inplace)
    rope = write_rows(cache.rope, slot_mapping, rope, inplace=inplace)
    if inplace:
        return cache
    return FP8LatentCache(values=value_bytes.view(cache.values.dtype), scales=scales, rope=rope)


# Overloads rather than the contract's type variable: `reference.latent` writes a cache of either type.
@overload
def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor, *,
             inplace: bool = True) -> torch.Tensor: ...
@overload
def write_kv(kv_cache: FP8LatentCache, slot_mapping: torch.Tensor, kv: torch.Tensor, *,
             inplace: bool = True) -> FP8LatentCache: ...


def write_kv(kv_cache: LatentCache, slot_mapping: torch.Tensor, kv: torch.Tensor, *,
             inplace: bool = True) -> LatentCache:
    """Write per-token rows `kv` [T, D] into a paged cache at `slot_mapping` [T] (-1: padding, see
    `write_rows`): a tensor [num_blocks, bs, D] takes them as they are (`write_rows`); an
    `FP8LatentCache` (D = C + R) takes them quantized (`quantize_latent`) into each of its leaves.
    Returns the cache with the rows written, of the type given: the same value when `inplace`,
    else a new one (the input left untouched)."""
    if isinstance(kv_cache, torch.Tensor):
        return write_rows(kv_cache, slot_mapping, kv, inplace=inplace)
    return _write_fp8_latent(kv_cache, slot_mapping, kv, inplace=inplace)
