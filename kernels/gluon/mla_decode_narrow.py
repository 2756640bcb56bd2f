"""Absorbed MLA decode of few heads on Hopper's warpgroup MMA, keys as the products' rows.

`mla_decode` puts 64 query rows a program on the warpgroup MMA's M; a sequence of 16 heads (DeepSeek-V2-Lite,
or V3 under eight-way tensor parallelism) has 16 rows, a quarter of that. Here the products run transposed:
the key tile is the M side and the heads the N side, so 16 heads fill an N of 16 and nothing is padded:

    S^T [64, H]  = K_nope Q_nope^T + K_pe Q_pe^T   keys (A) and queries (B) from shared memory
    online softmax over S^T's rows (a head's keys), base 2, -inf past the split or the sequence
    O^T [C, H]  += K_nope^T P^T                    K_nope read transposed (A), P^T through shared memory (B)

One program: the H <= BLOCK_H = 16 heads of one sequence (one query each) over one split of its keys, one
warpgroup, one stage of 64 keys gathered through the block table by `cp.async`; two programs share a
multiprocessor, so one's copies run under the other's products.

Its purpose is the FP8 latent cache (`FP8LatentCache`): a tile's e4m3 values come as bytes, the first half of
each row's into a buffer of their own and the second half into the stage's first quarter, and are widened
into the stage (`_widen`) to the dequantized rows, a group of 128 columns at a time. The next tile's
first half is copied as soon as the widening has read this one's, its RoPE values after the score product, its
second half after the value product. Over a 16-bit cache (FP8 False) it reads the tiles as they are, which the
tests use to check the FP8 path bit for bit (the op keeps the chunked `tl.dot` kernel for a 16-bit cache,
which streams it as fast).

Shared memory: the stage (64 x 576 16-bit values, 72 KiB), the first halves' bytes (16 KiB), Q (16 x 576) and
P^T (64 x 16), 108 KiB: two programs a multiprocessor. An earlier form, two warpgroups of 8 heads each over two
stages (one program a multiprocessor), read each tile twice in its products and ran 1.38 times slower at
B64 x 32K (bench/notes/fp8.md). Its output is the `tl.dot` kernels' split partials, merged by `decode_merge`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .mla_decode import (KV_LORA_RANK, ROPE_DIM, _copy_keys, _locate, _pages, available, copy_fp8_half, copy_rope,
                         copyable, load_scales)

# Heads a program (the products' N) and keys a tile (their M); one warpgroup.
BLOCK_H = 16
BLOCK_N = 64
NUM_WARPS = 4


def applies(num_heads: int, q_len: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
            device: torch.device) -> bool:
    """Whether the kernel takes a decode: one query of at most BLOCK_H heads a sequence, 16-bit, over a cache of
    DeepSeek's widths (C = 512, R = 64) on a Hopper GPU."""
    return (dtype in (torch.bfloat16, torch.float16) and q_len == 1 and num_heads <= BLOCK_H
            and kv_lora_rank == KV_LORA_RANK and rope_dim == ROPE_DIM and available(device))


@gluon.jit
def _softmax_value_product(s, m_i, l_i, acc, keys, p_smem, visible, scale_log2, o_layout: gl.constexpr):
    # One tile's online softmax over S^T [BLOCK_N, H] (keys `visible` [BLOCK_N] in S^T's row layout) and its
    # value product O^T += K^T P^T, left in flight (the caller waits for it); (m_i, l_i, acc). l_i [BLOCK_N, H]
    # holds each thread's share of the sums, summed once at the end: no exchange between the warps a tile for
    # them (H200, B64 x 32K: 591 against 615 us with the sums [H]).
    scores = gl.where(gl.expand_dims(visible, 1), s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=0))
    # A head may see no key of a tile (or of its split) yet: shift by 0 then, so weights are 0.
    shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - shift)
    p = gl.exp2(scores - gl.expand_dims(shift, 0))
    l_i = l_i * gl.expand_dims(alpha, 0) + p
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, o_layout)), 0)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()
    return m_new, l_i, warpgroup_mma(keys.permute((1, 0)), p_smem, acc, is_async=True)


@gluon.jit
def _high_bytes(k_nope):
    # The stage's first quarter as e4m3 bytes [BLOCK_N, C / 2]: where the second half of each row's values lands.
    # The stage's 128-byte swizzle keeps each 64-column slab of its rows together: these are the bytes of its
    # 16-bit columns 0 .. C / 4 (the first group of 128).
    BLOCK_N: gl.constexpr = k_nope.shape[0]
    HALF: gl.constexpr = k_nope.shape[1] // 2
    return k_nope._reinterpret(gl.float8e4nv, [4 * BLOCK_N, HALF],
                               gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).slice(0, BLOCK_N, dim=0)


@gluon.jit
def _copy_low(low_bytes, v_ptr, page, offset, valid, s_vn, s_vb, s_vd, KV_LORA_RANK: gl.constexpr,
              fp8_layout: gl.constexpr):
    # Starts copying the first C / 2 e4m3 values of the rows at (page, offset) [BLOCK_N] into low_bytes.
    rows: gl.constexpr = gl.SliceLayout(1, fp8_layout)
    copy_fp8_half(low_bytes, 0, v_ptr, gl.convert_layout(page, rows), gl.convert_layout(offset, rows),
                  gl.convert_layout(valid, rows), s_vn, s_vb, s_vd, KV_LORA_RANK, fp8_layout)


@gluon.jit
def _copy_high(k_nope, v_ptr, sc_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_scn, s_scb, s_scd,
               KV_LORA_RANK: gl.constexpr, fp8_layout: gl.constexpr):
    # Starts copying the last C / 2 e4m3 values of the rows at (page, offset) [BLOCK_N] into the stage's first
    # quarter (`_high_bytes`); returns the rows' four group scales (SliceLayout(1, fp8_layout)).
    rows: gl.constexpr = gl.SliceLayout(1, fp8_layout)
    page8 = gl.convert_layout(page, rows)
    offset8 = gl.convert_layout(offset, rows)
    valid8 = gl.convert_layout(valid, rows)
    copy_fp8_half(_high_bytes(k_nope), 1, v_ptr, page8, offset8, valid8, s_vn, s_vb, s_vd, KV_LORA_RANK, fp8_layout)
    return load_scales(sc_ptr, page8, offset8, valid8, s_scn, s_scb, s_scd)


@gluon.jit
def _widen(k_nope, low_bytes, sc0, sc1, sc2, sc3, fp8_layout: gl.constexpr):
    # The stage k_nope [BLOCK_N, C] from the bytes `_copy_low` and `_copy_high` put apart: each e4m3 value times
    # its group's scale [BLOCK_N] in float32, rounded once to k_nope's dtype (the rows `FP8LatentCache.rows`
    # gives), a group of 128 columns at a time, so that one group's values alone are live (widening in place,
    # as `mla_decode._widen` does, holds all four across its wait). Only the first group's 16-bit columns cover
    # `_high_bytes`: the last two groups (read from there) are written at once, and the first two once every
    # thread has read them.
    GROUP: gl.constexpr = 128
    high = _high_bytes(k_nope)
    dtype: gl.constexpr = k_nope.dtype
    f2 = high.slice(0, GROUP, dim=1).load(fp8_layout)
    k_nope.slice(2 * GROUP, GROUP, dim=1).store((f2.to(gl.float32) * gl.expand_dims(sc2, 1)).to(dtype))
    f3 = high.slice(GROUP, GROUP, dim=1).load(fp8_layout)
    k_nope.slice(3 * GROUP, GROUP, dim=1).store((f3.to(gl.float32) * gl.expand_dims(sc3, 1)).to(dtype))
    gl.thread_barrier()
    f0 = low_bytes.slice(0, GROUP, dim=1).load(fp8_layout)
    k_nope.slice(0, GROUP, dim=1).store((f0.to(gl.float32) * gl.expand_dims(sc0, 1)).to(dtype))
    f1 = low_bytes.slice(GROUP, GROUP, dim=1).load(fp8_layout)
    k_nope.slice(GROUP, GROUP, dim=1).store((f1.to(gl.float32) * gl.expand_dims(sc1, 1)).to(dtype))


# The split count follows the batch size: as a specialised int it would compile a kernel per value.
@gluon.jit(do_not_specialize=["num_splits", "s_plh"])
def _narrow_split_kernel(
    q_ptr, v_ptr, sc_ptr, r_ptr, bt_ptr, seq_lens_ptr, po_ptr, pl_ptr,
    num_heads, num_splits, scale_log2, s_sl,
    s_qb, s_qh, s_qd,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_btb, s_btw,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, FP8: gl.constexpr,
):
    # Program (sequence b, split) over the split's share of b's keys.
    BLOCK_H: gl.constexpr = 16
    BLOCK_N: gl.constexpr = 64
    SLAB: gl.constexpr = 64
    LN2: gl.constexpr = 0.6931471805599453
    b = gl.program_id(0)
    split = gl.program_id(1)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # Key copies: 16 bytes a thread, a warp 4 rows x 64 columns; FP8 bytes 16 a thread over 128 columns.
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    fp8_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    q_pe_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    # S^T [64 keys, 16 heads] and O^T [C, 16 heads]: the warpgroup's four warps the rows, the heads wgmma's N.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_H, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_H, 16])
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype)

    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA_RANK], smem_layout)
    q_pe = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE_DIM], smem_layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], p_smem_layout)
    k_nope = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA_RANK], smem_layout)
    k_pe = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE_DIM], smem_layout)
    # The first half of each row's e4m3 values (a token buffer over a 16-bit cache, which does not use it).
    LOW_COLS: gl.constexpr = KV_LORA_RANK // 2 if FP8 else 16
    low_bytes = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, LOW_COLS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    fp8_rows: gl.constexpr = gl.SliceLayout(1, fp8_layout)

    seq_len = gl.load(seq_lens_ptr + b * s_sl)
    # Whole tiles a split, so only a split's last tile is ragged.
    keys_per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = gl.minimum(start + keys_per_split, seq_len)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * s_btb
    offs_copy = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))

    # The queries join the first tile's copy group.
    heads_q = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
    q_rows = gl.expand_dims(q_ptr + b.to(gl.int64) * s_qb + heads_q * s_qh, 1)
    cols_q = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, q_layout))
    async_copy.async_copy_global_to_shared(q_nope, q_rows + gl.expand_dims(cols_q * s_qd, 0),
                                           gl.expand_dims(heads_q < num_heads, 1))
    heads_pe = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_pe_layout))
    cols_pe = gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, q_pe_layout))
    pe_rows = gl.expand_dims(q_ptr + b.to(gl.int64) * s_qb + heads_pe * s_qh, 1)
    async_copy.async_copy_global_to_shared(q_pe, pe_rows + gl.expand_dims((KV_LORA_RANK + cols_pe) * s_qd, 0),
                                           gl.expand_dims(heads_pe < num_heads, 1))

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)
    acc = gl.zeros([KV_LORA_RANK, BLOCK_H], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)

    # Tiles are located two ahead (their block-table reads a loop iteration before the copy that needs them);
    # a tile's key slots are the cache positions themselves (`_locate` without an index list).
    pos, valid = _locate(start + offs_copy, end, bt_row, 0, 0, False)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    # The group scales of the tile being widened, loaded with its second half (FP8 only; zeros otherwise).
    sc0 = gl.zeros([BLOCK_N], gl.float32, layout=fp8_rows)
    sc1 = sc0
    sc2 = sc0
    sc3 = sc0
    if FP8:
        _copy_low(low_bytes, v_ptr, page, offset, valid, s_vn, s_vb, s_vd, KV_LORA_RANK, fp8_layout)
        copy_rope(k_pe, r_ptr, page, offset, valid, s_rn, s_rb, s_rd, ROPE_DIM, copy_layout)
        sc0, sc1, sc2, sc3 = _copy_high(k_nope, v_ptr, sc_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_scn, s_scb,
                                        s_scd, KV_LORA_RANK, fp8_layout)
    else:
        _copy_keys(k_nope, k_pe, v_ptr, r_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_rn, s_rb, s_rd, KV_LORA_RANK,
                   SLAB, copy_layout)
    async_copy.commit_group()
    pos, valid = _locate(start + BLOCK_N + offs_copy, end, bt_row, 0, 0, False)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    copy_valid = valid
    pos, valid = _locate(start + 2 * BLOCK_N + offs_copy, end, bt_row, 0, 0, False)

    for t in range(num_tiles):
        n0 = start + t * BLOCK_N
        next_page, next_offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
        next_valid = valid
        pos, valid = _locate(n0 + 3 * BLOCK_N + offs_copy, end, bt_row, 0, 0, False)
        async_copy.wait_group(0)
        if FP8:
            gl.thread_barrier()
            _widen(k_nope, low_bytes, sc0, sc1, sc2, sc3, fp8_layout)
        fence_async_shared()
        gl.thread_barrier()
        if FP8:
            # Every thread has read tile t's first halves: tile t + 1's may come.
            _copy_low(low_bytes, v_ptr, page, offset, copy_valid, s_vn, s_vb, s_vd, KV_LORA_RANK, fp8_layout)

        s = warpgroup_mma(k_nope, q_nope.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(k_pe, q_pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if FP8:
            # The RoPE columns are the score product's alone.
            gl.thread_barrier()
            copy_rope(k_pe, r_ptr, page, offset, copy_valid, s_rn, s_rb, s_rd, ROPE_DIM, copy_layout)
        # The one query of sequence b stands at seq_len - 1 and sees every key below seq_len.
        m_i, l_i, acc = _softmax_value_product(s, m_i, l_i, acc, k_nope, p_smem, n0 + offs_n < end, scale_log2,
                                               o_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Every warp's value product over the stage has retired: the rest of tile t + 1 may come.
        gl.thread_barrier()
        if FP8:
            sc0, sc1, sc2, sc3 = _copy_high(k_nope, v_ptr, sc_ptr, page, offset, copy_valid, s_vn, s_vb, s_vd, s_scn,
                                            s_scb, s_scd, KV_LORA_RANK, fp8_layout)
        else:
            _copy_keys(k_nope, k_pe, v_ptr, r_ptr, page, offset, copy_valid, s_vn, s_vb, s_vd, s_rn, s_rb, s_rd,
                       KV_LORA_RANK, SLAB, copy_layout)
        async_copy.commit_group()
        page, offset, copy_valid = next_page, next_offset, next_valid
    async_copy.wait_group(0)

    l_sum = gl.sum(l_i, axis=0)
    has_keys = l_sum > 0.0
    l_safe = gl.where(has_keys, l_sum, 1.0)
    lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    heads_s = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_layout))
    gl.store(pl_ptr + b.to(gl.int64) * s_plb + heads_s * s_plh + split * s_pls, lse, mask=heads_s < num_heads)

    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(0, o_layout)), 0)
    heads_o = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, o_layout))
    cols_o = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(1, o_layout))
    po = po_ptr + b.to(gl.int64) * s_pob + split * s_pos
    gl.store(po + gl.expand_dims(heads_o * s_poh, 0) + gl.expand_dims(cols_o * s_pod, 1),
             out.to(po_ptr.dtype.element_ty), mask=gl.expand_dims(heads_o < num_heads, 0))


def narrow_split_decode(q: torch.Tensor, values: torch.Tensor, rope: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor, *,
                        softmax_scale_log2: float, scales: torch.Tensor | None = None) -> None:
    """Stage 1 of the split decode (`triton.decode.mla_decode`) for at most BLOCK_H heads and one query a
    sequence, on the warpgroup MMA.

    q [B, H, C + R] bf16/fp16 (any strides); values [nb, bs, C] and rope [nb, bs, R] (a plain cache's two views,
    in q's dtype), or an FP8 cache's leaves (values float8_e4m3fn, scales [nb, bs, C / 128] float32, rope in q's
    dtype); block_table [B, W] int32; seq_lens [B] int32; partial_out [B, H, S, C] and partial_lse [B, H, S]
    (float32 partials, or the outputs viewed as one split) are written: split s of sequence b covers its keys
    [s * k, min((s + 1) * k, seq_lens[b])), k = seq_lens[b] / S rounded up to whole 64-key tiles. Shapes are
    the caller's to check (`applies`, `mla_decode.copyable`, `triton.decode.mla_decode`).
    """
    num_seqs = q.shape[0]
    q = q if copyable(q) else q.contiguous()
    sc = values if scales is None else scales
    _narrow_split_kernel[(num_seqs, partial_out.shape[2])](
        q, values, sc, rope, block_table, seq_lens, partial_out, partial_lse,
        q.shape[1], partial_out.shape[2], softmax_scale_log2, seq_lens.stride(0),
        *q.stride(), *values.stride(), *sc.stride(), *rope.stride(), *block_table.stride(),
        *partial_out.stride(), *partial_lse.stride(),
        KV_LORA_RANK=KV_LORA_RANK, ROPE_DIM=ROPE_DIM, PAGE_SIZE=values.shape[1], FP8=scales is not None,
        num_warps=NUM_WARPS,
    )
