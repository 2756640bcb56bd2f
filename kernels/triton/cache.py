"""Writing per-token vectors into a paged cache, skipping padded slots: rows as they are, or latents to FP8."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..latent_cache import FP8LatentCache, LatentCacheT, cloned
from ._common import check_float, next_pow2, pdl
from .latent_parts import latent_parts, quant_group, store_latent_values


@triton.jit
def _token_slot(slot_ptr, stride_slot, kv_ptr, stride_kt, GDC: tl.constexpr):
    """This program's token: (its slot, int64, -1 for padding; its row of kv), read after the wait for
    the kernel before."""
    token = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    return tl.load(slot_ptr + token * stride_slot).to(tl.int64), kv_ptr + token.to(tl.int64) * stride_kt


@triton.jit
def _write_kv_kernel(
    cache_ptr, slot_ptr, kv_ptr,
    dim, block_size, stride_slot,
    stride_cn, stride_cb, stride_cd,
    stride_kt, stride_kd,
    BLOCK_D: tl.constexpr, GDC: tl.constexpr,
):
    slot, row = _token_slot(slot_ptr, stride_slot, kv_ptr, stride_kt, GDC)
    if slot >= 0:
        cols = tl.arange(0, BLOCK_D)
        dst = cache_ptr + (slot // block_size) * stride_cn + (slot % block_size) * stride_cb
        for d0 in range(0, dim, BLOCK_D):
            mask = d0 + cols < dim
            vals = tl.load(row + (d0 + cols) * stride_kd, mask=mask)
            tl.store(dst + (d0 + cols) * stride_cd, vals.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_fp8_latent_kernel(
    v_ptr, sc_ptr, r_ptr, slot_ptr, kv_ptr,
    block_size, stride_slot,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    stride_kt, stride_kd,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    QUANT_GROUP: tl.constexpr, GDC: tl.constexpr,
):
    slot, row = _token_slot(slot_ptr, stride_slot, kv_ptr, stride_kt, GDC)
    if slot >= 0:
        page = slot // block_size
        offset = slot % block_size
        cols = tl.arange(0, BLOCK_C)
        x = tl.load(row + cols * stride_kd, mask=cols < KV_LORA_RANK, other=0.0).to(tl.float32)
        store_latent_values(v_ptr + page * s_vn + offset * s_vb, sc_ptr + page * s_scn + offset * s_scb, x,
                            s_vd, s_scd, KV_LORA_RANK, BLOCK_C, QUANT_GROUP, True)
        r = tl.arange(0, BLOCK_R)
        pe = tl.load(row + (KV_LORA_RANK + r) * stride_kd, mask=r < ROPE_DIM)
        tl.store(r_ptr + page * s_rn + offset * s_rb + r * s_rd, pe.to(r_ptr.dtype.element_ty), mask=r < ROPE_DIM)


def _write_fp8_latent(cache: FP8LatentCache, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """`reference.cache.write_kv` of an FP8 cache, in place: kv [T, C + R] rows quantized per token."""
    kv_lora_rank = cache.kv_lora_rank
    parts = latent_parts(cache, kv_lora_rank)
    block_c = next_pow2(kv_lora_rank)
    use_pdl = pdl(kv.device)
    _write_fp8_latent_kernel[(slot_mapping.shape[0],)](
        *parts.pointers(), slot_mapping, kv,
        cache.shape[1], slot_mapping.stride(0), *parts.strides(), *kv.stride(),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=cache.shape[2] - kv_lora_rank, BLOCK_C=block_c,
        BLOCK_R=next_pow2(cache.shape[2] - kv_lora_rank), QUANT_GROUP=quant_group(block_c), GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )


def write_kv(
    kv_cache: LatentCacheT,
    slot_mapping: torch.Tensor,
    kv: torch.Tensor,
    *,
    inplace: bool = True,
) -> LatentCacheT:
    """Write `kv` into the paged cache at `slot_mapping`.

    kv_cache:     [num_blocks, block_size, D], or an `FP8LatentCache` (D = C + R), which takes the
                  rows quantized as `reference.cache.quantize_latent` does, bit for bit
    slot_mapping: [T] int32/int64, slot = block * block_size + offset; -1 marks padding
    kv:           [T, D] (any strides; cast to the cache dtype)
    returns       the cache with the rows written, of the type given. `inplace=True` writes
                  into `kv_cache` and returns it; `inplace=False` clones the cache first
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
    check_float("kv", kv)
    if not inplace:
        kv_cache = cloned(kv_cache)
    if not isinstance(kv_cache, torch.Tensor):
        check_same_device(kv_cache=kv_cache.rope, slot_mapping=slot_mapping, kv=kv)
        if num_tokens:
            _write_fp8_latent(kv_cache, slot_mapping, kv)
        return kv_cache
    check_float("kv_cache", kv_cache)
    check_same_device(kv_cache=kv_cache, slot_mapping=slot_mapping, kv=kv)
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
