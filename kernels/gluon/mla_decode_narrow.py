"""Absorbed MLA decode of few heads over an FP8 latent cache on Hopper's warpgroup MMA, keys as the products' rows.

`mla_decode` puts 64 query rows a program on the warpgroup MMA's M; a sequence of 16 heads (DeepSeek-V2-Lite,
or V3 under eight-way tensor parallelism) has 16 rows, a quarter of that. Here the products run transposed:
the key tile is the M side and the heads the N side, so 16 heads fill an N of 16 and nothing is padded:

    S^T [64, H]  = (K_nope Q_nope'^T + K_pe Q_pe'^T) q_scale  keys (A) and queries (B) from shared memory
    online softmax over S^T's rows (a head's keys), base 2, -inf past the split or the sequence
    O^T [C, H]  += K_nope^T P^T                               K_nope read transposed (A), P^T through shared memory (B)

One program: the H <= BLOCK_H = 16 heads of one sequence (one query each) over one split of its keys, one
warpgroup, one stage of 64 keys gathered through the block table by `cp.async`; two programs share a
multiprocessor, so one's copies run under the other's products.

It reads the FP8 latent cache (`FP8LatentCache`): a tile's e4m3 values come as bytes, the first half of each
row's into a buffer of their own and the second half into the stage's first quarter, and are widened into the
stage (`_widen`), a group of 128 columns at a time. The latent products run in float16, not in the queries'
dtype: an e4m3 value is exact in float16, so widening is one conversion (two values an instruction) and one
float16 product by the group's scale (rounded to float16), where the queries' bf16 took a float32 product and a
rounding (B64 x 32K at 16 heads on an H200: 554 us against 594-607, bench/notes/fp8.md), and the widened rows
keep 11 significant bits, not bf16's 8: the outputs are nearer the float32-dequantized rows than the bf16 rows
`FP8LatentCache.rows` gives are. So that float16 holds them, a head's query is divided by a power of two
(`q_scale`, 1 unless its largest Q_nope magnitude passes 2^15; exact) and its scores multiplied back, and a scale
above 65504 / 448 (a latent group of larger magnitudes, which float16 cannot hold) is clipped to it. The RoPE
product stays in the queries' dtype; P is float16 (its weights are at most 1). The next tile's first half is
copied as soon as the widening has read this one's, its RoPE values after the score product, its second half
after the value product. (A plain cache keeps the chunked `tl.dot` kernel, which streams it as fast.)

Shared memory: the stage (64 x 512 float16 values and 64 x 64 RoPE values, 72 KiB), the first halves' bytes
(16 KiB), Q (16 x 576) and P^T (64 x 16), 108 KiB: two programs a multiprocessor. An earlier form, two
warpgroups of 8 heads each over two stages (one program a multiprocessor), read each tile twice in its products
and ran 1.38 times slower at B64 x 32K (bench/notes/fp8.md). Its output is the `tl.dot` kernels' split
partials, merged by `decode_merge`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .mla_decode import KV_LORA_RANK, ROPE_DIM, _locate, _pages, copy_fp8_half, copy_rope, copyable, load_scales
from .support import available

# Heads a program (the products' N) and keys a tile (their M); one warpgroup.
BLOCK_H = 16
BLOCK_N = 64
NUM_WARPS = 4


# The largest group scale the float16 stage takes: 448 times it is float16's largest finite value, 65504.
SCALE_MAX = 146.0

# A warpgroup's layouts over the keys-as-rows kernels' tiles (here and in `dsa_decode_narrow`). Copies: 16 bytes a
# thread, a warp 4 rows x 64 columns; queries: a warp a head's row. S^T [64 keys, 16 heads] and O^T [C, 16 heads]
# as the warpgroup MMA leaves them: its four warps the rows, the heads its N. Stages: the 128-byte swizzle of
# 16-bit values.
COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
Q_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_H, 16]))
STAGE_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


def applies(num_heads: int, q_len: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, fp8: bool,
            device: torch.device) -> bool:
    """Whether the kernel takes a decode: one 16-bit query of at most BLOCK_H heads a sequence over an FP8 cache
    of DeepSeek's widths (C = 512, R = 64) on a Hopper GPU."""
    return (fp8 and dtype in (torch.bfloat16, torch.float16) and q_len == 1 and num_heads <= BLOCK_H
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
               KV_LORA_RANK: gl.constexpr, fp8_layout: gl.constexpr, SCALE_MAX: gl.constexpr):
    # Starts copying the last C / 2 e4m3 values of the rows at (page, offset) [BLOCK_N] into the stage's first
    # quarter (`_high_bytes`); returns the rows' four group scales (SliceLayout(1, fp8_layout)), clipped to
    # SCALE_MAX as they load (clipped as they widen, the compares cost registers: B64 x 32K at 601 us against
    # 553 on an H200).
    rows: gl.constexpr = gl.SliceLayout(1, fp8_layout)
    page8 = gl.convert_layout(page, rows)
    offset8 = gl.convert_layout(offset, rows)
    valid8 = gl.convert_layout(valid, rows)
    copy_fp8_half(_high_bytes(k_nope), 1, v_ptr, page8, offset8, valid8, s_vn, s_vb, s_vd, KV_LORA_RANK, fp8_layout)
    sc0, sc1, sc2, sc3 = load_scales(sc_ptr, page8, offset8, valid8, s_scn, s_scb, s_scd)
    return (gl.minimum(sc0, SCALE_MAX), gl.minimum(sc1, SCALE_MAX), gl.minimum(sc2, SCALE_MAX),
            gl.minimum(sc3, SCALE_MAX))


@gluon.jit
def _widened(values, scale):
    # e4m3 values [BLOCK_N, 128] times their row's group scale [BLOCK_N] (`_copy_high`'s), in float16: the
    # conversion is exact, the product rounded once (the scale first rounded to float16).
    return values.to(gl.float16) * gl.expand_dims(scale.to(gl.float16), 1)


@gluon.jit
def _widen(k_nope, low_bytes, sc0, sc1, sc2, sc3, fp8_layout: gl.constexpr):
    # The float16 stage k_nope [BLOCK_N, C] from the bytes `_copy_low` and `_copy_high` put apart (`_widened`), a
    # group of 128 columns at a time, so that one group's values alone are live (widening in place, as
    # `mla_decode._widen` does, holds all four across its wait). Only the first group's 16-bit columns cover
    # `_high_bytes`: the last two groups (read from there) are written at once, and the first two once every
    # thread has read them.
    GROUP: gl.constexpr = 128
    high = _high_bytes(k_nope)
    k_nope.slice(2 * GROUP, GROUP, dim=1).store(_widened(high.slice(0, GROUP, dim=1).load(fp8_layout), sc2))
    k_nope.slice(3 * GROUP, GROUP, dim=1).store(_widened(high.slice(GROUP, GROUP, dim=1).load(fp8_layout), sc3))
    gl.thread_barrier()
    k_nope.slice(0, GROUP, dim=1).store(_widened(low_bytes.slice(0, GROUP, dim=1).load(fp8_layout), sc0))
    k_nope.slice(GROUP, GROUP, dim=1).store(_widened(low_bytes.slice(GROUP, GROUP, dim=1).load(fp8_layout), sc1))


@gluon.jit
def _store_query(q_nope, q_pe, q_ptr, b, num_heads, s_qb, s_qh, s_qd, KV_LORA_RANK: gl.constexpr,
                 q_layout: gl.constexpr, q_pe_layout: gl.constexpr):
    # Sequence b's query into q_nope [BLOCK_H, C] (float16) and q_pe [BLOCK_H, R] (q's dtype), each head divided
    # by a power of two that brings its largest Q_nope magnitude to at most 2^15 (1 below that; exact either
    # way); returns the powers [BLOCK_H] (SliceLayout(1, q_layout)), by which the scores are multiplied back.
    # Heads past num_heads are 0.
    BLOCK_H: gl.constexpr = q_nope.shape[0]
    ROPE_DIM: gl.constexpr = q_pe.shape[1]
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
    cols = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, q_layout))
    rows = gl.expand_dims(q_ptr + b.to(gl.int64) * s_qb + heads * s_qh, 1)
    q = gl.load(rows + gl.expand_dims(cols * s_qd, 0), mask=gl.expand_dims(heads < num_heads, 1), other=0.0)
    q = q.to(gl.float32)
    largest = gl.max(gl.abs(q), axis=1)
    # A head of zeros (or a padded one): log2 is -inf, the power 1.
    q_scale = gl.exp2(gl.maximum(gl.ceil(gl.log2(largest)) - 15.0, 0.0))
    q_nope.store((q * gl.expand_dims(1.0 / q_scale, 1)).to(gl.float16))
    heads_pe = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_pe_layout))
    cols_pe = gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, q_pe_layout))
    pe_rows = gl.expand_dims(q_ptr + b.to(gl.int64) * s_qb + heads_pe * s_qh, 1)
    pe = gl.load(pe_rows + gl.expand_dims((KV_LORA_RANK + cols_pe) * s_qd, 0),
                 mask=gl.expand_dims(heads_pe < num_heads, 1), other=0.0)
    pe_scale = gl.convert_layout(1.0 / q_scale, gl.SliceLayout(1, q_pe_layout))
    q_pe.store((pe.to(gl.float32) * gl.expand_dims(pe_scale, 1)).to(q_pe.dtype))
    return q_scale


@gluon.jit
def _store_partials(po_ptr, pl_ptr, b, split, num_heads, m_i, l_i, acc, s_pob, s_poh, s_pos, s_pod, s_plb, s_plh,
                    s_pls):
    # A keys-as-rows program's split partials for sequence (or row) b: the LSE (natural log; -inf for a head
    # that saw no key) from the maxima m_i [H] and the per-thread sums l_i [BLOCK_N, H] in S^T's layout, and the
    # normalised output from acc = O^T [C, H]; heads past num_heads are not written.
    LN2: gl.constexpr = 0.6931471805599453
    BLOCK_H: gl.constexpr = acc.shape[1]
    KV_LORA_RANK: gl.constexpr = acc.shape[0]
    s_layout: gl.constexpr = l_i.type.layout
    o_layout: gl.constexpr = acc.type.layout
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
    KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, SCALE_MAX: gl.constexpr,
):
    # Program (sequence b, split) over the split's share of b's keys.
    BLOCK_H: gl.constexpr = 16
    BLOCK_N: gl.constexpr = 64
    b = gl.program_id(0)
    split = gl.program_id(1)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # RoPE copies: COPY_LAYOUT's; FP8 bytes 16 a thread over 128 columns.
    copy_layout: gl.constexpr = COPY_LAYOUT
    fp8_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    q_layout: gl.constexpr = Q_LAYOUT
    q_pe_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    s_layout: gl.constexpr = ACC_LAYOUT
    o_layout: gl.constexpr = ACC_LAYOUT
    smem_layout: gl.constexpr = STAGE_LAYOUT
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16)

    q_nope = gl.allocate_shared_memory(gl.float16, [BLOCK_H, KV_LORA_RANK], smem_layout)
    q_pe = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE_DIM], smem_layout)
    p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_N, BLOCK_H], p_smem_layout)
    k_nope = gl.allocate_shared_memory(gl.float16, [BLOCK_N, KV_LORA_RANK], smem_layout)
    k_pe = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE_DIM], smem_layout)
    # The first half of each row's e4m3 values.
    low_bytes = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_N, KV_LORA_RANK // 2],
                                          gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    seq_len = gl.load(seq_lens_ptr + b * s_sl)
    # Whole tiles a split, so only a split's last tile is ragged.
    keys_per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = gl.minimum(start + keys_per_split, seq_len)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * s_btb
    offs_copy = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))

    # Tiles are located two ahead (their block-table reads a loop iteration before the copy that needs them);
    # a tile's key slots are the cache positions themselves (`_locate` without an index list).
    pos, valid = _locate(start + offs_copy, end, bt_row, 0, 0, False)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    _copy_low(low_bytes, v_ptr, page, offset, valid, s_vn, s_vb, s_vd, KV_LORA_RANK, fp8_layout)
    copy_rope(k_pe, r_ptr, page, offset, valid, s_rn, s_rb, s_rd, ROPE_DIM, copy_layout)
    # The group scales of the tile being widened, loaded with its second half.
    sc0, sc1, sc2, sc3 = _copy_high(k_nope, v_ptr, sc_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_scn, s_scb,
                                    s_scd, KV_LORA_RANK, fp8_layout, SCALE_MAX)
    async_copy.commit_group()
    # The query is scaled and stored under the first tile's copy.
    q_scale = gl.convert_layout(_store_query(q_nope, q_pe, q_ptr, b, num_heads, s_qb, s_qh, s_qd, KV_LORA_RANK,
                                             q_layout, q_pe_layout), gl.SliceLayout(0, s_layout))
    pos, valid = _locate(start + BLOCK_N + offs_copy, end, bt_row, 0, 0, False)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    copy_valid = valid
    pos, valid = _locate(start + 2 * BLOCK_N + offs_copy, end, bt_row, 0, 0, False)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)
    acc = gl.zeros([KV_LORA_RANK, BLOCK_H], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)

    for t in range(num_tiles):
        n0 = start + t * BLOCK_N
        next_page, next_offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
        next_valid = valid
        pos, valid = _locate(n0 + 3 * BLOCK_N + offs_copy, end, bt_row, 0, 0, False)
        async_copy.wait_group(0)
        gl.thread_barrier()
        _widen(k_nope, low_bytes, sc0, sc1, sc2, sc3, fp8_layout)
        fence_async_shared()
        gl.thread_barrier()
        # Every thread has read tile t's first halves: tile t + 1's may come.
        _copy_low(low_bytes, v_ptr, page, offset, copy_valid, s_vn, s_vb, s_vd, KV_LORA_RANK, fp8_layout)

        s = warpgroup_mma(k_nope, q_nope.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(k_pe, q_pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        # The RoPE columns are the score product's alone.
        gl.thread_barrier()
        copy_rope(k_pe, r_ptr, page, offset, copy_valid, s_rn, s_rb, s_rd, ROPE_DIM, copy_layout)
        # The one query of sequence b stands at seq_len - 1 and sees every key below seq_len.
        m_i, l_i, acc = _softmax_value_product(s * gl.expand_dims(q_scale, 0), m_i, l_i, acc, k_nope, p_smem,
                                               n0 + offs_n < end, scale_log2, o_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Every warp's value product over the stage has retired: the rest of tile t + 1 may come.
        gl.thread_barrier()
        sc0, sc1, sc2, sc3 = _copy_high(k_nope, v_ptr, sc_ptr, page, offset, copy_valid, s_vn, s_vb, s_vd, s_scn,
                                        s_scb, s_scd, KV_LORA_RANK, fp8_layout, SCALE_MAX)
        async_copy.commit_group()
        page, offset, copy_valid = next_page, next_offset, next_valid
    async_copy.wait_group(0)

    _store_partials(po_ptr, pl_ptr, b, split, num_heads, m_i, l_i, acc, s_pob, s_poh, s_pos, s_pod, s_plb, s_plh,
                    s_pls)


def narrow_split_decode(q: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, partial_out: torch.Tensor,
                        partial_lse: torch.Tensor, *, softmax_scale_log2: float) -> None:
    """Stage 1 of the split decode (`triton.decode.mla_decode`) for at most BLOCK_H heads and one query a
    sequence over an FP8 cache, on the warpgroup MMA.

    q [B, H, C + R] bf16/fp16 (any strides); values [nb, bs, C] float8_e4m3fn, scales [nb, bs, C / 128] float32
    and rope [nb, bs, R] in q's dtype (an `FP8LatentCache`'s leaves); block_table [B, W] int32; seq_lens [B]
    int32; partial_out [B, H, S, C] and partial_lse [B, H, S] (float32 partials, or the outputs viewed as one
    split) are written: split s of sequence b covers its keys [s * k, min((s + 1) * k, seq_lens[b])),
    k = seq_lens[b] / S rounded up to whole 64-key tiles. Shapes are the caller's to check (`applies`,
    `mla_decode.copyable`, `triton.decode.mla_decode`).
    """
    num_seqs = q.shape[0]
    q = q if copyable(q) else q.contiguous()
    _narrow_split_kernel[(num_seqs, partial_out.shape[2])](
        q, values, scales, rope, block_table, seq_lens, partial_out, partial_lse,
        q.shape[1], partial_out.shape[2], softmax_scale_log2, seq_lens.stride(0),
        *q.stride(), *values.stride(), *scales.stride(), *rope.stride(), *block_table.stride(),
        *partial_out.stride(), *partial_lse.stride(),
        KV_LORA_RANK=KV_LORA_RANK, ROPE_DIM=ROPE_DIM, PAGE_SIZE=values.shape[1], SCALE_MAX=SCALE_MAX,
        num_warps=NUM_WARPS,
    )
