"""V3.2's sparse decode of few heads over a 16-bit latent cache on Hopper's warpgroup MMA, keys as the products' rows.

The twin of `triton/dsa_decode.py`'s `_sparse_split_kernel` at up to 16 heads a row: the same inputs and split
partials. As in `mla_decode_narrow` (the dense decode over an FP8 cache), a 64-key tile is the products' M side
and the heads their N side, so 16 heads fill an N of 16 where the `tl.dot` kernel's MMA is the older one:

    S^T [64, H]  = K_nope Q_nope^T + K_pe Q_pe^T    keys (A) and queries (B) from shared memory
    online softmax over S^T's rows (a head's keys), base 2, -inf on slots that are no key
    O^T [C, H]  += K_nope^T P^T                     K_nope read transposed (A), P^T through shared memory (B)

One program: the H <= BLOCK_H heads of one row over one split of its index list, one warpgroup, two stages of
64 latent rows gathered by `cp.async` (index list, then block table, each a loop iteration ahead of the copy
that needs it): tile t + 1 is copied while tile t is multiplied. Shared memory: two stages (72 KiB each), Q and
P^T, 164 KiB, so one program runs on a multiprocessor and the splits fill one wave of them
(`dsa_decode._NARROW_CONFIG`). H200, 16 heads, top-2048, both stages: B64 x 32K 47.7-48.6 us against the
twin's 53.0-54.1; below 8 rows, where a split is one tile, the twin is faster (bench/notes/dsa.md). A second program a
multiprocessor of one stage each (92 KiB) ran as fast as the twin; L2 prefetches of the tile after next slowed
both.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .mla_decode import KV_LORA_RANK, ROPE_DIM, _copy_keys, _locate, _pages, copyable
from .mla_decode_narrow import (ACC_LAYOUT, COPY_LAYOUT, Q_LAYOUT, STAGE_LAYOUT, _softmax_value_product,
                                _store_partials)
from .support import available

# Heads a program (the products' N) and keys a tile (their M); one warpgroup.
BLOCK_H = 16
BLOCK_N = 64
NUM_WARPS = 4


def applies(num_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, fp8: bool,
            device: torch.device) -> bool:
    """Whether the kernel takes a sparse decode: 16-bit queries of at most BLOCK_H heads a row over a 16-bit cache
    of DeepSeek's widths (C = 512, R = 64) on a Hopper GPU. (The cache must also be `copyable`.)"""
    return (not fp8 and dtype in (torch.bfloat16, torch.float16) and num_heads <= BLOCK_H
            and kv_lora_rank == KV_LORA_RANK and rope_dim == ROPE_DIM and available(device))


# The split count and the list's length follow the batch: as specialised ints they would compile a kernel per
# value.
@gluon.jit(do_not_specialize=["num_splits", "top_k", "num_positions", "s_plh"])
def _narrow_sparse_split_kernel(
    q_ptr, v_ptr, r_ptr, bt_ptr, idx_ptr, po_ptr, pl_ptr,
    num_heads, num_splits, top_k, num_positions, scale_log2,
    s_qb, s_qh, s_qd,
    s_vn, s_vb, s_vd, s_rn, s_rb, s_rd,
    s_btb, s_btw, s_it, s_ik,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
):
    # Program (row b, split) over the split's share of b's top_k index slots.
    BLOCK_H: gl.constexpr = 16
    BLOCK_N: gl.constexpr = 64
    SLAB: gl.constexpr = 64
    b = gl.program_id(0)
    split = gl.program_id(1)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)

    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA_RANK], STAGE_LAYOUT)
    q_pe = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE_DIM], STAGE_LAYOUT)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], p_smem_layout)
    k_nope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA_RANK], STAGE_LAYOUT)
    k_pe = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE_DIM], STAGE_LAYOUT)

    # Whole tiles a split, so only a split's last tile is ragged.
    slots_per_split = gl.cdiv(gl.cdiv(top_k, num_splits), BLOCK_N) * BLOCK_N
    start = split * slots_per_split
    end = gl.minimum(start + slots_per_split, top_k)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * s_btb
    idx_row = idx_ptr + b.to(gl.int64) * s_it
    offs_copy = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY_LAYOUT))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC_LAYOUT))

    # The first tile's rows are copied before the queries are read; the rows of each later tile are located
    # two tiles ahead (its index slots an iteration before its block-table reads), so no copy waits on a load.
    pos, valid = _locate(start + offs_copy, end, idx_row, num_positions, s_ik, True)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    _copy_keys(k_nope.index(0), k_pe.index(0), v_ptr, r_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_rn, s_rb,
               s_rd, KV_LORA_RANK, SLAB, COPY_LAYOUT)
    async_copy.commit_group()
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_LAYOUT))
    q_rows = gl.expand_dims(q_ptr + b.to(gl.int64) * s_qb + heads * s_qh, 1)
    q_mask = gl.expand_dims(heads < num_heads, 1)
    cols = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, Q_LAYOUT))
    q_nope.store(gl.load(q_rows + gl.expand_dims(cols * s_qd, 0), mask=q_mask, other=0.0))
    cols_pe = gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, Q_LAYOUT))
    q_pe.store(gl.load(q_rows + gl.expand_dims((KV_LORA_RANK + cols_pe) * s_qd, 0), mask=q_mask, other=0.0))

    pos, valid = _locate(start + BLOCK_N + offs_copy, end, idx_row, num_positions, s_ik, True)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    copy_valid = valid
    pos, valid = _locate(start + 2 * BLOCK_N + offs_copy, end, idx_row, num_positions, s_ik, True)
    # Which of tile t's slots are keys, in S^T's row layout, read a tile ahead too. Every valid position is
    # below the table's end (`_locate`): no causal bound to apply.
    _, key_s = _locate(start + offs_n, end, idx_row, num_positions, s_ik, True)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC_LAYOUT))
    l_i = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ACC_LAYOUT)
    acc = gl.zeros([KV_LORA_RANK, BLOCK_H], gl.float32, layout=ACC_LAYOUT)
    s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ACC_LAYOUT)

    for t in range(num_tiles):
        n0 = start + t * BLOCK_N
        stage = t % 2
        next_page, next_offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
        next_valid = valid
        pos, valid = _locate(n0 + 3 * BLOCK_N + offs_copy, end, idx_row, num_positions, s_ik, True)
        _, next_key_s = _locate(n0 + BLOCK_N + offs_n, end, idx_row, num_positions, s_ik, True)
        # Tile t + 1 into the stage whose products (tile t - 1's) every warp is past; then tile t's copy (and,
        # the first time, the queries' stores) done in this thread, made visible to the tensor cores' proxy,
        # then done in every thread.
        _copy_keys(k_nope.index(1 - stage), k_pe.index(1 - stage), v_ptr, r_ptr, page, offset, copy_valid, s_vn,
                   s_vb, s_vd, s_rn, s_rb, s_rd, KV_LORA_RANK, SLAB, COPY_LAYOUT)
        async_copy.commit_group()
        async_copy.wait_group(1)
        fence_async_shared()
        gl.thread_barrier()
        keys = k_nope.index(stage)
        s = warpgroup_mma(keys, q_nope.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(k_pe.index(stage), q_pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        m_i, l_i, acc = _softmax_value_product(s, m_i, l_i, acc, keys, p_smem, key_s, scale_log2, ACC_LAYOUT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()
        page, offset, copy_valid = next_page, next_offset, next_valid
        key_s = next_key_s
    async_copy.wait_group(0)

    _store_partials(po_ptr, pl_ptr, b, split, num_heads, m_i, l_i, acc, s_pob, s_poh, s_pos, s_pod, s_plb, s_plh,
                    s_pls)


def narrow_sparse_split_decode(q: torch.Tensor, values: torch.Tensor, rope: torch.Tensor, block_table: torch.Tensor,
                               indices: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor, *,
                               softmax_scale_log2: float) -> None:
    """Stage 1 of the sparse decode (`triton.dsa_decode.sparse_mla_decode`) for at most BLOCK_H heads a row over a
    16-bit cache, on the warpgroup MMA.

    q [T, H, C + R] bf16/fp16 (any strides); values [nb, bs, C] and rope [nb, bs, R] (a plain cache's two views, in
    q's dtype); block_table [T, W] int32; indices [T, k] int32 positions into row t's table (-1, or any outside
    [0, W * bs): none); partial_out [T, H, S, C] and partial_lse [T, H, S] (float32 partials, or the outputs
    viewed as one split) are written: split s of row t covers its index slots [s * j, min((s + 1) * j, k)),
    j = k / S rounded up to whole 64-slot tiles (the twin's). Shapes are the caller's to check (`applies`,
    `mla_decode.copyable`, `triton.dsa_decode.sparse_mla_decode`).
    """
    q = q if copyable(q) else q.contiguous()
    _narrow_sparse_split_kernel[(q.shape[0], partial_out.shape[2])](
        q, values, rope, block_table, indices, partial_out, partial_lse,
        q.shape[1], partial_out.shape[2], indices.shape[1], block_table.shape[1] * values.shape[1],
        softmax_scale_log2,
        *q.stride(), *values.stride(), *rope.stride(), *block_table.stride(), *indices.stride(),
        *partial_out.stride(), *partial_lse.stride(),
        KV_LORA_RANK=KV_LORA_RANK, ROPE_DIM=ROPE_DIM, PAGE_SIZE=values.shape[1],
        num_warps=NUM_WARPS,
    )
