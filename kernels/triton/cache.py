"""Writing latent KV vectors into the paged cache, skipping padded slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ._common import check_float, next_pow2, pdl


@triton.jit
def _write_kv_kernel(
    cache_ptr, slot_ptr, kv_ptr,
    dim, block_size, stride_slot,
    stride_cn, stride_cb, stride_cd,
    stride_kt, stride_kd,
    BLOCK_D: tl.constexpr, GDC: tl.constexpr,
):
    token = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK_D)
        row = kv_ptr + token.to(tl.int64) * stride_kt
        dst = cache_ptr + (slot // block_size) * stride_cn + (slot % block_size) * stride_cb
        for d0 in range(0, dim, BLOCK_D):
            mask = d0 + cols < dim
            vals = tl.load(row + (d0 + cols) * stride_kd, mask=mask)
            tl.store(dst + (d0 + cols) * stride_cd, vals.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: torch.Tensor,
    *,
    inplace: bool = True,
) -> torch.Tensor:
    """Write `kv` into the paged cache at `slot_mapping`.

    kv_cache:     [num_blocks, block_size, D]
    slot_mapping: [T] int32/int64, slot = block * block_size + offset; -1 marks padding
    kv:           [T, D] (any strides; cast to the cache dtype)
    returns       the cache with the rows written. `inplace=True` writes into
                  `kv_cache` and returns it; `inplace=False` clones the cache first
                  (a full copy) and leaves the input untouched.

    Padded rows (-1) write nothing at all, unlike the reference, which parks them
    in slot 0 of the scratch block; no sequence reads that slot, so both agree on
    everything that is ever attended.
    """
    num_blocks, block_size, dim = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_shape("kv", kv, (num_tokens, dim))
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    check_float("kv_cache", kv_cache)
    check_float("kv", kv)
    check_same_device(kv_cache=kv_cache, slot_mapping=slot_mapping, kv=kv)
    if not inplace:
        kv_cache = kv_cache.clone()
    if num_tokens == 0:
        return kv_cache
    # One program per token row; a 576-wide row fits one 1024-lane block.
    block_d = min(1024, next_pow2(dim))
    use_pdl = pdl(kv.device)
    _write_kv_kernel[(num_tokens,)](
        kv_cache, slot_mapping, kv,
        dim, block_size, slot_mapping.stride(0),
        *kv_cache.stride(),
        *kv.stride(),
        BLOCK_D=block_d, GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )
    return kv_cache
