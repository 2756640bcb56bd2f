"""Writing latent KV vectors into the paged cache."""

from __future__ import annotations

import torch

from ..checks import as_dtype, check_shape


def write_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: torch.Tensor,
    *,
    inplace: bool = True,
) -> torch.Tensor:
    """Write `kv` into the paged cache at `slot_mapping`.

    kv_cache:     [num_blocks, block_size, D]
    slot_mapping: [T] integer, slot = block * block_size + offset; -1 marks padding
    kv:           [T, D], same dtype as the cache
    returns       the cache with the rows written: the same tensor when `inplace`,
                  a new one otherwise (the input is then left untouched, which is
                  what differentiation and branching need).

    Padding (-1) writes into slot 0 of block 0, the scratch block that the block
    allocator never hands out and no sequence reads, so that the write stays a
    single static-shape `index_copy` with no host sync.
    """
    num_blocks, block_size, dim = kv_cache.shape
    check_shape("kv", kv, (slot_mapping.shape[0], dim))
    flat = kv_cache.view(num_blocks * block_size, dim)
    slots = slot_mapping.clamp(min=0)
    if inplace:
        flat.index_copy_(0, slots, as_dtype(kv, kv_cache.dtype))
        return kv_cache
    return flat.index_copy(0, slots, kv.to(kv_cache.dtype)).view(num_blocks, block_size, dim)
