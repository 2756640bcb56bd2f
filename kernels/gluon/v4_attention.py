"""DeepSeek-V4's window + compressed-entry attention, stage 1, on Hopper's warpgroup MMA (Gluon).

The twin of `triton/v4_attention.py`'s `_v4_split_kernel`: the same inputs and the same split partials
(normalised output and natural-log LSE a split; with one split and FOLD_SINK, the outputs themselves,
sink folded in), so `_v4_merge_kernel` merges them with the sink. `triton.v4_attention.wgmma_parts`
says where the op takes it.

Each row (one query token) attends over one virtual key list: its window's n_w = min(window, key_len)
keys (positions [key_len - n_w, key_len) of the window cache, through block_table), then its n_e
compressed entries (entries 0..n_e-1 for HCA, the first n_e slots of the index list for CSA, each only
if 0 <= e < key_len // rate and inside the entry table), through entry_table into the entries cache.
Keys are the values (K = V, D = 512), all heads share them.

One program: BLOCK_M = 64 heads of one row over one split of its list, as two warpgroups that take its
32-key tiles in turn (warp-specialized partitions: warpgroup w the tiles w, w + 2, ...), each with its own
two stages and its own softmax state, so one warpgroup's softmax and copies run beside the other's
products. Per tile, in one warpgroup:

    S [64, 32]   = Q K^T      warpgroup MMA, both operands in shared memory
    online softmax over S in registers (base 2, -inf on slots that are no key)
    O [64, 256] += P K        warpgroup MMA, P from registers, the program's half of K's columns

At the end warpgroup 1 leaves its (m, l, O) in shared memory and warpgroup 0 merges them into its own.
Each warpgroup copies half of Q beside its first tiles. Shared memory: Q [64, 512] and four [32, 512] stages
(128-byte swizzle), 193 KiB with the scratch: one program a multiprocessor. An earlier form, the two
warpgroups on one 64-key tile (each half of its keys in S, half of O's columns), exchanged the softmax's
maxima, sums and P between them every tile: 1.14-1.17x this one's time at B64 x 64K on an H200 (HCA 31.5
against 27.0 us, CSA 42.7 against 37.4; bench/notes/v4.md).

A tile's rows are gathered with `cp.async` (16 bytes a thread a copy), each key from the window cache
or the entries cache; where a warpgroup's next tile sits is located (index list, block tables) under its
current tile's products. With an index list, a tile's entry ids are read a tile before its block tables
(`_entry_ids`), and which of its slots are keys two tiles before its scores, carried as the bits of one
register (`_key_bits`). Slots that are no key are zero-filled by the copy (never read), so P K over them
is 0, never NaN; their scores are -inf. A split covers whole 64-key runs (the twin's tiles), so the
partials are the twin's slot for slot.

d_split = D_SPLIT = 2: two programs a (row, head group, split), neighbours in the grid, each computing the
whole S but P K for one half of the output columns. Twice the programs without split partials (at batch
64 one split then fills an H100), for 1.5x the products; the second read of a tile comes from L2. (With
all 512 columns a warpgroup, its O would take 256 registers a thread.)

d_split = 1 (where the rows alone fill the multiprocessors): one program a (row, head group, split) computes
each tile's scores once (`_shared_scores_tiles`). The warpgroups still own the tiles in turn (each copies
its own, computes their S and softmax), but each accumulates only its half of the output columns, over
every tile: after its softmax a tile's owner publishes P [64, 32] and the new maxima in shared memory
(an mbarrier a warpgroup), and the other, whose running maxima were the owner's starting ones, rescales
its O to them and adds P K over its half of the tile, P read from shared memory, then frees the tile's
stage and P (a second mbarrier) for the owner's next copy. Both end on the same maxima; the sums of
their own tiles' weights add. Each warpgroup locates its tile after next under its value product, so no
table read stands between a freed stage and its copy. H200, B = 128 x 64K: 1.5x faster than the `tl.dot`
twin (HCA 38.2 against 57.0 us); at B = 64 (64 programs, or two splits and their merge) slower than two
programs a row (bench/notes/v4.md).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .dependent_launch import gdc_launch_dependents, gdc_wait
from .mla_decode import copyable, softmax_step
from .support import available

BLOCK_M = 64
# Keys a warpgroup's tile, and the runs a split covers (the twin's tile).
BLOCK_N = 32
SPLIT_TILE = 64
D_SPLIT = 2
# Warps a warpgroup (each partition is one); registers a thread in either (ptxas's ceiling: O alone is 128).
WARPGROUP_WARPS = 4
WARPGROUP_REGISTERS = 256
HEAD_DIM = 512
# The FP8 caches the kernel reads (`FP8LatentCache`): V4's 448 latent values a key (three scale groups of 128
# and one of 64) and 64 RoPE values.
FP8_KV_C = 448


# ln 2 and log2 e: the softmax runs in base 2; the sinks come in, and the LSE goes out, in base e.
LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
# A warpgroup's layouts (4 warps) over the kernel's tiles. Copies: 16 bytes a thread, a warp 4 rows x 64
# columns; FP8 bytes 16 a thread over 128 columns (the 64-column group's tail as the 16-bit copies).
COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
FP8_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
# S [64, BLOCK_N] and O [64, HEAD_DIM / 2] as the warpgroup MMA leaves them; P as the value product's
# register operand.
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HEAD_DIM // 2, 16]))
P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
# A stage's 64-column slabs lie one after another (128-byte swizzle), so each half of its columns is one
# [BLOCK_N, HEAD_DIM / 2] buffer: a half is taken by index.
HALVES_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

def applies(num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel can take the op: 16-bit queries, D = 512, at least 64 heads (one full program a
    row), a Hopper GPU. (The caches must also be `copyable`.)"""
    return (dtype in (torch.bfloat16, torch.float16) and head_dim == HEAD_DIM and num_heads >= BLOCK_M
            and available(device))


@gluon.jit
def _entry_ids(j, end, n_win, n_ent, idx_row, s_ik):
    # The index list's entries at virtual slots j, -1 where a slot is no entry slot: what `_locate` reads, which
    # a loop reads a tile before the rest of that tile's location (the block tables it then reads depend on it).
    slot = j - n_win
    return gl.load(idx_row + slot * s_ik, mask=(j < end) & (slot >= 0) & (slot < n_ent), other=-1)


@gluon.jit
def _locate(j, ids, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik,
            HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr):
    # (position in its cache, is a window key, is an entry key) of virtual key slots j: slot j < n_win is
    # window position win_start + j; slot n_win + i is entry i (HCA) or the entry the index list holds at
    # slot i (CSA: -1, or not below entry_count, the complete entries inside the table, is no key). The
    # position is 0 where the slot is no key. ids: with an index list, its entries at j read ahead
    # (`_entry_ids`), or None to read them here.
    in_range = j < end
    is_win = in_range & (j < n_win)
    pos = win_start + j
    is_ent = in_range & (j < 0)
    if HAS_ENTRIES:
        slot = j - n_win
        is_ent = in_range & (slot >= 0) & (slot < n_ent)
        if HAS_INDICES:
            if ids is None:
                e = gl.load(idx_row + slot * s_ik, mask=is_ent, other=-1)
            else:
                e = ids
        else:
            e = slot
        is_ent = is_ent & (e >= 0) & (e < entry_count)
        pos = gl.where(is_win, pos, e)
    pos = gl.where(is_win | is_ent, pos, 0)
    return pos, is_win, is_ent


@gluon.jit
def _key_bits(first, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, BLOCK_N: gl.constexpr,
              HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr):
    # Which of the BLOCK_N virtual slots from `first` are keys, as the bits of one int32 (bit j: slot first + j),
    # a slot a lane (the sum is a warp's shuffles): with an index list a tile's keys are then read two tiles
    # ahead and carried in a register, not read under the tile's own score product, whose wait they lengthened
    # (H200, B64 x 64K: the loop without its copies, products and softmax took 14.7 us over CSA's list against
    # 8.8 over HCA's arithmetic; with the bits ahead CSA 34.0 -> 30.3 us, over FP8 caches 54.0 -> 47.7).
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    j = gl.arange(0, BLOCK_N, layout=layout)
    _, is_win, is_ent = _locate(first + j, None, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, HAS_ENTRIES,
                                HAS_INDICES)
    return gl.sum(gl.where(is_win | is_ent, 1 << j, 0), axis=0)


@gluon.jit
def _keys_of(bits, offs):
    # `_key_bits`' bits as a mask over offs (slot offsets from its first).
    return ((bits >> offs) & 1) != 0


@gluon.jit
def _rows(pos, is_win, is_ent, win_ptr, ent_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb,
          PAGE: gl.constexpr, ENTRY_PAGE: gl.constexpr, HAS_ENTRIES: gl.constexpr):
    # (row pointer, is a key) of located slots: the block-table reads a later copy waits on. Page and
    # offset times their strides, so the pointers keep the strides' 16-byte alignment for cp.async.
    w_page = gl.load(bt_row + (pos // PAGE) * s_btw, mask=is_win, other=0).to(gl.int64)
    row = win_ptr + w_page * s_wn + (pos % PAGE).to(gl.int64) * s_wb
    if HAS_ENTRIES:
        e_page = gl.load(et_row + (pos // ENTRY_PAGE) * s_etw, mask=is_ent, other=0).to(gl.int64)
        row = gl.where(is_ent, ent_ptr + e_page * s_en + (pos % ENTRY_PAGE).to(gl.int64) * s_eb, row)
    return row, is_win | is_ent


@gluon.jit
def _copy_rows(buf, row, ok, s_d, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    # Starts copying the rows `row` [N] (SliceLayout(1, layout)) into a [N, HEAD_DIM] buffer; rows not `ok`
    # are zero-filled. One copy op over the whole tile: the same 16-byte cp.async a thread as a copy a
    # 64-column slab, without the barrier Triton puts between copies into slices of one buffer.
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(buf, gl.expand_dims(row, 1) + gl.expand_dims(cols * s_d, 0),
                                           gl.expand_dims(ok, 1))


@gluon.jit
def _copy_fp8_rows(raw_buf, key_buf, row, rope_row, ok, KV_C: gl.constexpr, HEAD_DIM: gl.constexpr,
                   fp8_layout: gl.constexpr, tail_layout: gl.constexpr, copy_layout: gl.constexpr):
    # Starts copying FP8 keys' rows: their KV_C e4m3 values (`row` [N] into the values leaf,
    # SliceLayout(1, copy_layout)) as bytes into raw_buf [N, >= KV_C], three 128-column groups and a 64-column
    # one; their HEAD_DIM - KV_C RoPE values (`rope_row`) straight into their columns of key_buf [N, HEAD_DIM],
    # where the widened values do not reach. Rows not `ok` are zero-filled.
    GROUP: gl.constexpr = 128
    TAIL: gl.constexpr = KV_C - 3 * GROUP
    rows = gl.expand_dims(gl.convert_layout(row, gl.SliceLayout(1, fp8_layout)), 1)
    mask = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, fp8_layout)), 1)
    cols = gl.expand_dims(gl.arange(0, GROUP, layout=gl.SliceLayout(0, fp8_layout)), 0)
    for g in gl.static_range(3):
        async_copy.async_copy_global_to_shared(raw_buf.slice(g * GROUP, GROUP, dim=1), rows + g * GROUP + cols, mask)
    tail_rows = gl.expand_dims(gl.convert_layout(row, gl.SliceLayout(1, tail_layout)), 1)
    tail_mask = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, tail_layout)), 1)
    tail_cols = gl.expand_dims(gl.arange(0, TAIL, layout=gl.SliceLayout(0, tail_layout)), 0)
    async_copy.async_copy_global_to_shared(raw_buf.slice(3 * GROUP, TAIL, dim=1), tail_rows + 3 * GROUP + tail_cols,
                                           tail_mask)
    rope_cols = gl.arange(0, HEAD_DIM - KV_C, layout=gl.SliceLayout(0, copy_layout))
    async_copy.async_copy_global_to_shared(key_buf.slice(KV_C, HEAD_DIM - KV_C, dim=1),
                                           gl.expand_dims(rope_row, 1) + gl.expand_dims(rope_cols, 0),
                                           gl.expand_dims(ok, 1))


@gluon.jit
def _load_fp8_scales(scale_row, ok, fp8_layout: gl.constexpr, tail_layout: gl.constexpr):
    # The four group scales of keys' rows (`scale_row` [N] into the scales leaf): three [N] in
    # SliceLayout(1, fp8_layout), the 64-column group's in SliceLayout(1, tail_layout); 0 where not `ok`.
    rows = gl.convert_layout(scale_row, gl.SliceLayout(1, fp8_layout))
    mask = gl.convert_layout(ok, gl.SliceLayout(1, fp8_layout))
    tail_rows = gl.convert_layout(scale_row, gl.SliceLayout(1, tail_layout))
    tail_mask = gl.convert_layout(ok, gl.SliceLayout(1, tail_layout))
    return (gl.load(rows, mask=mask, other=0.0), gl.load(rows + 1, mask=mask, other=0.0),
            gl.load(rows + 2, mask=mask, other=0.0), gl.load(tail_rows + 3, mask=tail_mask, other=0.0))


@gluon.jit
def _widen(raw_buf, key_buf, sc0, sc1, sc2, sc3, KV_C: gl.constexpr, fp8_layout: gl.constexpr,
           tail_layout: gl.constexpr):
    # Dequantizes a stage in place: the e4m3 values in raw_buf [N, >= KV_C] (the stage's first bytes) times
    # their group's scale in float32, rounded once to key_buf's dtype, into key_buf's first KV_C columns: the
    # rows `FP8LatentCache.rows` gives. Every thread reads its values before any thread writes over them.
    GROUP: gl.constexpr = 128
    TAIL: gl.constexpr = KV_C - 3 * GROUP
    dtype: gl.constexpr = key_buf.dtype
    f0 = raw_buf.slice(0, GROUP, dim=1).load(fp8_layout)
    f1 = raw_buf.slice(GROUP, GROUP, dim=1).load(fp8_layout)
    f2 = raw_buf.slice(2 * GROUP, GROUP, dim=1).load(fp8_layout)
    f3 = raw_buf.slice(3 * GROUP, TAIL, dim=1).load(tail_layout)
    gl.thread_barrier()
    key_buf.slice(0, GROUP, dim=1).store((f0.to(gl.float32) * gl.expand_dims(sc0, 1)).to(dtype))
    key_buf.slice(GROUP, GROUP, dim=1).store((f1.to(gl.float32) * gl.expand_dims(sc1, 1)).to(dtype))
    key_buf.slice(2 * GROUP, GROUP, dim=1).store((f2.to(gl.float32) * gl.expand_dims(sc2, 1)).to(dtype))
    key_buf.slice(3 * GROUP, TAIL, dim=1).store((f3.to(gl.float32) * gl.expand_dims(sc3, 1)).to(dtype))


@gluon.jit
def _tile_rows(first, offs, ids, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr,
               es_ptr, wr_ptr, er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb, s_wsn, s_wsb, s_esn,
               s_esb, s_wrn, s_wrb, s_ern, s_erb, PAGE: gl.constexpr, ENTRY_PAGE: gl.constexpr,
               HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr, FP8: gl.constexpr):
    # (row pointers into the values, is a key, row pointers into the scales, into the RoPE values) of the
    # tile at virtual slot `first` (`offs` [N]); the last two are the first where the caches are 16-bit. ids:
    # `_locate`'s.
    pos, is_win, is_ent = _locate(first + offs, ids, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik,
                                  HAS_ENTRIES, HAS_INDICES)
    row, ok = _rows(pos, is_win, is_ent, win_ptr, ent_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb,
                    PAGE, ENTRY_PAGE, HAS_ENTRIES)
    scale_row = row
    rope_row = row
    if FP8:
        scale_row = _rows(pos, is_win, is_ent, ws_ptr, es_ptr, bt_row, et_row, s_btw, s_etw, s_wsn, s_wsb, s_esn,
                          s_esb, PAGE, ENTRY_PAGE, HAS_ENTRIES)[0]
        rope_row = _rows(pos, is_win, is_ent, wr_ptr, er_ptr, bt_row, et_row, s_btw, s_etw, s_wrn, s_wrb, s_ern,
                         s_erb, PAGE, ENTRY_PAGE, HAS_ENTRIES)[0]
    return row, ok, scale_row, rope_row


@gluon.jit
def _copy_tile(stage, row, ok, rope_row, s_wd, HEAD_DIM: gl.constexpr, FP8: gl.constexpr, KV_C: gl.constexpr,
               fp8_layout: gl.constexpr, tail_layout: gl.constexpr, copy_layout: gl.constexpr):
    # Starts a tile's copy into `stage`: 16-bit rows as they are, or an FP8 tile's bytes into the stage's first
    # half (`_raw`) and its RoPE values into their columns.
    if FP8:
        _copy_fp8_rows(_raw(stage, row.dtype.element_ty), stage, row, rope_row, ok, KV_C, HEAD_DIM, fp8_layout,
                       tail_layout, copy_layout)
    else:
        _copy_rows(stage, row, ok, s_wd, HEAD_DIM, copy_layout)


@gluon.jit
def _raw(stage, fp8_dtype: gl.constexpr):
    # A stage [N, D] 16-bit as the bytes of N FP8 rows of D (its first half): where a tile's e4m3 values land.
    N: gl.constexpr = stage.shape[0]
    D: gl.constexpr = stage.shape[1]
    return stage._reinterpret(fp8_dtype, [2 * N, D], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).slice(0, N, dim=0)


@gluon.jit
def _next_rows(n0, offs_c, offs_n, key_bits, ids, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik,
               win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr, er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb,
               s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
               ENTRY_PAGE: gl.constexpr, HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr, FP8: gl.constexpr):
    # `_tile_rows` of a warpgroup's tile after next (slot n0 + 4 BLOCK_N, offs_c [BLOCK_N]), which slots of its
    # tile at n0 are keys (offs_n [BLOCK_N], as the scores lay them out), and what the loop carries on: key bits
    # and entry ids. With an index list the tile's keys come from `key_bits` (its `_key_bits`, read two tiles
    # before) and the tile after next's rows from `ids` (its `_entry_ids`, read a tile before), and the bits and
    # ids returned are those of the tile after next and of the one after it; without one the keys are arithmetic,
    # and both pass through.
    row, ok, scale_row, rope_row = _tile_rows(n0 + 4 * BLOCK_N, offs_c, ids, end, n_win, win_start, n_ent,
                                              entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr,
                                              er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb, s_wsn,
                                              s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, PAGE, ENTRY_PAGE,
                                              HAS_ENTRIES, HAS_INDICES, FP8)
    if HAS_INDICES:
        is_key = _keys_of(key_bits, offs_n)
        key_bits = _key_bits(n0 + 4 * BLOCK_N, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, BLOCK_N,
                             HAS_ENTRIES, HAS_INDICES)
        ids = _entry_ids(n0 + 6 * BLOCK_N + offs_c, end, n_win, n_ent, idx_row, s_ik)
    else:
        _, win_s, ent_s = _locate(n0 + offs_n, None, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik,
                                  HAS_ENTRIES, HAS_INDICES)
        is_key = win_s | ent_s
    return row, ok, scale_row, rope_row, is_key, key_bits, ids


@gluon.jit
def _start_warpgroup(q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, t64, head_group, num_heads, start, end, n_win,
                     win_start, n_ent, entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr, er_ptr,
                     bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb,
                     s_ern, s_erb, s_wd, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
                     ENTRY_PAGE: gl.constexpr, HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr,
                     FP8: gl.constexpr, KV_C: gl.constexpr, WG: gl.constexpr, copy_layout: gl.constexpr,
                     fp8_layout: gl.constexpr, tail_layout: gl.constexpr):
    # Warpgroup WG's start: copies its half of Q (its own commit group, the first), then its first two tiles
    # (slots start + WG BLOCK_N and start + (WG + 2) BLOCK_N) into its stages 2 WG and 2 WG + 1; waits for its
    # half of Q, then for the other's (q_bar). Returns the first tile's FP8 scales (zeros over 16-bit caches) and
    # the second's scale rows and key mask, whose scales are loaded once the first tile is widened.
    BLOCK_M: gl.constexpr = 64
    HALF_M: gl.constexpr = BLOCK_M // 2
    heads_q = head_group * BLOCK_M + WG * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, copy_layout))
    _copy_rows(q_smem.slice(WG * HALF_M, HALF_M, dim=0), q_ptr + t64 * s_qt + heads_q.to(gl.int64) * s_qh,
               heads_q < num_heads, s_qd, HEAD_DIM, copy_layout)
    async_copy.commit_group()
    offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    row, ok, scale_row, rope_row = _tile_rows(start + WG * BLOCK_N, offs_c, None, end, n_win, win_start, n_ent,
                                              entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr,
                                              er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb, s_wsn,
                                              s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, PAGE, ENTRY_PAGE,
                                              HAS_ENTRIES, HAS_INDICES, FP8)
    _copy_tile(k_smem.index(2 * WG), row, ok, rope_row, s_wd, HEAD_DIM, FP8, KV_C, fp8_layout, tail_layout,
               copy_layout)
    async_copy.commit_group()
    if FP8:
        # The scales of the tile the loop widens first.
        sc0, sc1, sc2, sc3 = _load_fp8_scales(scale_row, ok, fp8_layout, tail_layout)
    else:
        sc0 = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, fp8_layout))
        sc1 = sc0
        sc2 = sc0
        sc3 = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, tail_layout))
    row, ok, scale_row, rope_row = _tile_rows(start + (WG + 2) * BLOCK_N, offs_c, None, end, n_win, win_start, n_ent,
                                              entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr,
                                              er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb, s_wsn,
                                              s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, PAGE, ENTRY_PAGE,
                                              HAS_ENTRIES, HAS_INDICES, FP8)
    _copy_tile(k_smem.index(2 * WG + 1), row, ok, rope_row, s_wd, HEAD_DIM, FP8, KV_C, fp8_layout, tail_layout,
               copy_layout)
    async_copy.commit_group()
    # This half of the queries is in (its group is the first), the other warpgroup's once both arrive.
    async_copy.wait_group(2)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(q_bar, count=1)
    mbarrier.wait(q_bar, 0)
    return sc0, sc1, sc2, sc3, scale_row, ok


@gluon.jit
def _softmax_start(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, OUT_D: gl.constexpr):
    # A warpgroup's loop state before its first tile: the slot offsets its scores lay out (offs_n [BLOCK_N]),
    # the running maxima (-inf) and sums, its output [BLOCK_M, OUT_D] and the zero scores its products start from.
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    acc = gl.zeros([BLOCK_M, OUT_D], gl.float32, layout=O_LAYOUT)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)
    return offs_n, m_i, l_i, acc, s_zero


@gluon.jit
def _first_key_bits(start, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, BLOCK_N: gl.constexpr,
                    HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr, WG: gl.constexpr):
    # With an index list, `_key_bits` of warpgroup WG's first two tiles (slots start + WG BLOCK_N and
    # start + (WG + 2) BLOCK_N), which the loop carries on; zeros without one (never read).
    key_bits = 0
    next_bits = 0
    if HAS_INDICES:
        key_bits = _key_bits(start + WG * BLOCK_N, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik,
                             BLOCK_N, HAS_ENTRIES, HAS_INDICES)
        next_bits = _key_bits(start + (WG + 2) * BLOCK_N, end, n_win, win_start, n_ent, entry_count, idx_row,
                              s_ik, BLOCK_N, HAS_ENTRIES, HAS_INDICES)
    return key_bits, next_bits


@gluon.jit
def _third_ids(start, offs_c, end, n_win, n_ent, idx_row, s_ik, BLOCK_N: gl.constexpr, HAS_INDICES: gl.constexpr,
               WG: gl.constexpr):
    # With an index list, `_entry_ids` of warpgroup WG's third tile (slots start + (WG + 4) BLOCK_N + offs_c),
    # where its loop's first location starts; 0 without one (never read).
    ids = 0
    if HAS_INDICES:
        ids = _entry_ids(start + (WG + 4) * BLOCK_N + offs_c, end, n_win, n_ent, idx_row, s_ik)
    return ids


@gluon.jit
def _warpgroup_tiles(q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, o_smem, ml_smem, done_bar, win_ptr, ent_ptr,
                     bt_row, et_row, idx_row, ws_ptr, es_ptr, wr_ptr, er_ptr, po_ptr, pl_ptr, sink_ptr,
                     t64, head_group, d_part, split, num_heads, start, end, n_win, win_start, n_ent, entry_count,
                     scale_log2, s_sink, s_wd, s_btw, s_etw, s_ik, s_wn, s_wb, s_en, s_eb,
                     s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb,
                     s_pot, s_poh, s_pos, s_pod, s_plt, s_plh, s_pls,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, ENTRY_PAGE: gl.constexpr,
                     HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr, FOLD_SINK: gl.constexpr,
                     FP8: gl.constexpr, KV_C: gl.constexpr, WG: gl.constexpr):
    # Warpgroup WG's share of a program: its tiles WG, WG + 2, ... of the split, in its stages 2 WG and 2 WG + 1
    # by turns, with its own softmax state. Warpgroup 1 leaves (m, l, O) in shared memory; warpgroup 0 merges
    # them into its own and writes the program's outputs.
    BLOCK_M: gl.constexpr = 64
    OUT_D: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = q_smem.dtype

    # Half of Q (its own group, the first), then the first two tiles.
    sc0, sc1, sc2, sc3, next_scale_row, next_ok = _start_warpgroup(
        q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, t64, head_group, num_heads, start, end, n_win, win_start,
        n_ent, entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr, er_ptr, bt_row, et_row, s_btw,
        s_etw, s_wn, s_wb, s_en, s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, s_wd, HEAD_DIM,
        BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES, HAS_INDICES, FP8, KV_C, WG, COPY_LAYOUT, FP8_LAYOUT, COPY_LAYOUT)
    offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY_LAYOUT))

    offs_n, m_i, l_i, acc, s_zero = _softmax_start(BLOCK_M, BLOCK_N, OUT_D)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    # With an index list: the key bits of this warpgroup's tile and of its next (`_next_rows`).
    key_bits, next_bits = _first_key_bits(start, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, BLOCK_N,
                                          HAS_ENTRIES, HAS_INDICES, WG)
    ids = _third_ids(start, offs_c, end, n_win, n_ent, idx_row, s_ik, BLOCK_N, HAS_INDICES, WG)
    # Where the loop reads its tables: under the score product, but before the widening over FP8 caches with an
    # index list (see below).
    READ_EARLY: gl.constexpr = FP8 and HAS_INDICES
    for i in range((num_tiles - WG + 1) // 2):
        n0 = start + (2 * i + WG) * BLOCK_N
        stage = k_smem.index(2 * WG + i % 2)
        if READ_EARLY:
            # Where this stage's next tile sits, read before the widening (see below).
            row, ok, scale_row, rope_row, is_key, after_bits, ids = _next_rows(
                n0, offs_c, offs_n, key_bits, ids, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, win_ptr,
                ent_ptr, ws_ptr, es_ptr, wr_ptr, er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb,
                s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES,
                HAS_INDICES, FP8)
        # This tile's copies are done in this thread (the next one's may still fly), made visible to the
        # tensor cores' proxy, then done in every thread of the warpgroup.
        async_copy.wait_group(1)
        if FP8:
            # Every thread's bytes are in before any thread widens over them.
            gl.thread_barrier()
            _widen(_raw(stage, win_ptr.dtype.element_ty), stage, sc0, sc1, sc2, sc3, KV_C, FP8_LAYOUT, COPY_LAYOUT)
            sc0, sc1, sc2, sc3 = _load_fp8_scales(next_scale_row, next_ok, FP8_LAYOUT, COPY_LAYOUT)
        fence_async_shared()
        gl.thread_barrier()

        s = warpgroup_mma(q_smem, stage.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if not READ_EARLY:
            # Where this stage's next tile sits (this warpgroup's after next): its tables and index list read
            # under the score product (H200, B64 x 64K: CSA 38.2 -> 34.2 us, HCA 28.7 -> 27.4, over FP8 caches
            # HCA 40.6 -> 39.0). Over FP8 caches with an index list they are read before the widening: under the
            # product CSA ran 50.5 us against 47.7 (62d16ae; 56.4 against 53.4 at 5b7715f / d8bce13).
            row, ok, scale_row, rope_row, is_key, after_bits, ids = _next_rows(
                n0, offs_c, offs_n, key_bits, ids, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, win_ptr,
                ent_ptr, ws_ptr, es_ptr, wr_ptr, er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb,
                s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES,
                HAS_INDICES, FP8)
        key_bits = next_bits
        next_bits = after_bits
        if FP8:
            # The next widening's scales are read after this one from the rows located last: now this iteration's.
            next_scale_row = scale_row
            next_ok = ok
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        m_i, l_i, alpha, p = softmax_step(gl.where(gl.expand_dims(is_key, 0), s * scale_log2, float("-inf")), m_i,
                                          l_i)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
        half = stage._reinterpret(dtype, [2, BLOCK_N, OUT_D], HALVES_LAYOUT).index(d_part)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), P_LAYOUT), half, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Every warp of this warpgroup is past its products over the stage: its next tile may come.
        gl.thread_barrier()
        _copy_tile(stage, row, ok, rope_row, s_wd, HEAD_DIM, FP8, KV_C, FP8_LAYOUT, COPY_LAYOUT, COPY_LAYOUT)
        async_copy.commit_group()
    async_copy.wait_group(0)

    if WG == 1:
        o_smem.index(1).store(acc)
        ml_smem.index(0).store(m_i)
        ml_smem.index(1).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done_bar, count=1)
    else:
        mbarrier.wait(done_bar, 0)
        m_1 = ml_smem.index(0).load(gl.SliceLayout(1, S_LAYOUT))
        l_1 = ml_smem.index(1).load(gl.SliceLayout(1, S_LAYOUT))
        m_f = gl.maximum(m_i, m_1)
        shift_f = gl.where(m_f == float("-inf"), 0.0, m_f)
        a_0 = gl.exp2(m_i - shift_f)
        a_1 = gl.exp2(m_1 - shift_f)
        l_i = l_i * a_0 + l_1 * a_1
        m_i = shift_f
        heads_s = head_group * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
        real_s = heads_s < num_heads
        if FOLD_SINK:
            # The only split: the sink joins here as one more logit with a zero value.
            sink = gl.load(sink_ptr + heads_s * s_sink, mask=real_s, other=0.0).to(gl.float32) * LOG2E
            m_f = gl.maximum(m_i, sink)
            shift_f = gl.where(m_f == float("-inf"), 0.0, m_f)
            alpha_f = gl.exp2(m_i - shift_f)
            l_i = l_i * alpha_f + gl.exp2(sink - shift_f)
            a_0 = a_0 * alpha_f
            a_1 = a_1 * alpha_f
            m_i = shift_f
        has_keys = l_i > 0.0
        l_safe = gl.where(has_keys, l_i, 1.0)
        lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        # Both programs of a (row, split) computed the same LSE (the same scores): the first writes it.
        gl.store(pl_ptr + t64 * s_plt + heads_s * s_plh + split * s_pls, lse, mask=real_s & (d_part == 0))
        # O = (O_0 a_0 + O_1 a_1) / l, 64 columns at a time through shared memory (both O in registers at once
        # would not fit), stored in 16-byte runs a thread.
        o_smem.index(0).store(acc * gl.expand_dims(gl.convert_layout(a_0 / l_safe, gl.SliceLayout(1, O_LAYOUT)), 1))
        gl.thread_barrier()
        CHUNK: gl.constexpr = 64
        chunk_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        w_1 = gl.expand_dims(gl.convert_layout(a_1 / l_safe, gl.SliceLayout(1, chunk_layout)), 1)
        heads_k = head_group * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, chunk_layout))
        cols_k = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_layout))
        po_rows = gl.expand_dims(po_ptr + t64 * s_pot + heads_k.to(gl.int64) * s_poh + split * s_pos, 1)
        for c in gl.static_range(OUT_D // CHUNK):
            o_0 = o_smem.index(0).slice(c * CHUNK, CHUNK, dim=1).load(chunk_layout)
            o_1 = o_smem.index(1).slice(c * CHUNK, CHUNK, dim=1).load(chunk_layout)
            gl.store(po_rows + gl.expand_dims((d_part * OUT_D + c * CHUNK + cols_k) * s_pod, 0),
                     (o_0 + o_1 * w_1).to(po_ptr.dtype.element_ty), mask=gl.expand_dims(heads_k < num_heads, 1))


@gluon.jit
def _take_other_tile(acc, m_i, l_i, s, stage, p_buf, m_buf, pm_bar, free_bar, phase, WG: gl.constexpr,
                     s_layout: gl.constexpr, o_layout: gl.constexpr, halves_layout: gl.constexpr,
                     BLOCK_N: gl.constexpr, OUT_D: gl.constexpr):
    # This warpgroup's columns of the other warpgroup's tile: its maxima and weights once published, the
    # output so far rescaled to them, P K over this warpgroup's half of the tile's columns (P from shared
    # memory). `s`, this warpgroup's own score product, ran under the wait; it is done before the output's
    # registers are rescaled (ptxas would wait for it there anyway).
    dtype: gl.constexpr = stage.dtype
    mbarrier.wait(pm_bar, phase)
    m_new = m_buf.load(gl.SliceLayout(1, s_layout))
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - shift)
    l_i = l_i * alpha
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    half = stage._reinterpret(dtype, [2, BLOCK_N, OUT_D], halves_layout).index(WG)
    acc = warpgroup_mma(p_buf, half, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    # Every warp is past its product over the tile and its weights: the owner may reuse both.
    gl.thread_barrier()
    mbarrier.arrive(free_bar, count=1)
    return acc, m_new, l_i, s


@gluon.jit
def _shared_scores_tiles(q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, p_smem, m_smem, l_smem, pm_bars,
                         free_bars, end_bar, win_ptr, ent_ptr,
                         bt_row, et_row, idx_row, ws_ptr, es_ptr, wr_ptr, er_ptr, po_ptr, pl_ptr, sink_ptr,
                         t64, head_group, split, num_heads, start, end, n_win, win_start, n_ent, entry_count,
                         scale_log2, s_sink, s_wd, s_btw, s_etw, s_ik, s_wn, s_wb, s_en, s_eb,
                         s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb,
                         s_pot, s_poh, s_pos, s_pod, s_plt, s_plh, s_pls,
                         HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
                         ENTRY_PAGE: gl.constexpr, HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr,
                         FOLD_SINK: gl.constexpr, FP8: gl.constexpr, KV_C: gl.constexpr, WG: gl.constexpr):
    # Warpgroup WG's share of a program that computes each tile's scores once: the split's 32-key tiles
    # g = WG, WG + 2, ... are its own (copied into its stages 2 WG + j % 2, their scores and softmax its
    # own, the weights P and new maxima published to the other through shared memory); of every tile, its
    # own or the other's, it accumulates its half of the output columns. Both warpgroups keep the same
    # running maxima (a tile's owner starts from the other's last); each sums the weights of its own tiles.
    BLOCK_M: gl.constexpr = 64
    OUT_D: gl.constexpr = HEAD_DIM // 2
    OTHER: gl.constexpr = 1 - WG
    dtype: gl.constexpr = q_smem.dtype

    sc0, sc1, sc2, sc3, next_scale_row, next_ok = _start_warpgroup(
        q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, t64, head_group, num_heads, start, end, n_win, win_start,
        n_ent, entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr, er_ptr, bt_row, et_row, s_btw,
        s_etw, s_wn, s_wb, s_en, s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, s_wd, HEAD_DIM,
        BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES, HAS_INDICES, FP8, KV_C, WG, COPY_LAYOUT, FP8_LAYOUT, COPY_LAYOUT)
    offs_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY_LAYOUT))

    offs_n, m_i, l_i, acc, s_zero = _softmax_start(BLOCK_M, BLOCK_N, OUT_D)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    # (The loop locates each tile after next; this one, its third, the first iteration locates again.)
    row, ok, scale_row, rope_row = _tile_rows(start + (WG + 4) * BLOCK_N, offs_c, None, end, n_win, win_start, n_ent,
                                              entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr, wr_ptr,
                                              er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en, s_eb, s_wsn,
                                              s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, PAGE, ENTRY_PAGE,
                                              HAS_ENTRIES, HAS_INDICES, FP8)
    key_bits, next_bits = _first_key_bits(start, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik, BLOCK_N,
                                          HAS_ENTRIES, HAS_INDICES, WG)
    # With an index list over 16-bit caches, the entry ids of the tile the loop locates next, read a tile ahead
    # (H200, B128 x 64K CSA 45.6 -> 43.7 us); over FP8 caches it stays in the location (68.0 against 64.8).
    IDS_AHEAD: gl.constexpr = HAS_INDICES and not FP8
    ids = None
    if IDS_AHEAD:
        ids = _third_ids(start, offs_c, end, n_win, n_ent, idx_row, s_ik, BLOCK_N, HAS_INDICES, WG)
    for j in range((num_tiles - WG + 1) // 2):
        g = 2 * j + WG
        n0 = start + g * BLOCK_N
        stage = k_smem.index(2 * WG + j % 2)
        if j > 0:
            # The other warpgroup is past this warpgroup's previous tile: its stage takes the tile after this
            # (located under the previous tile's value product).
            mbarrier.wait(free_bars.index(WG), (j - 1) % 2)
            _copy_tile(k_smem.index(2 * WG + (j + 1) % 2), row, ok, rope_row, s_wd, HEAD_DIM, FP8, KV_C,
                       FP8_LAYOUT, COPY_LAYOUT, COPY_LAYOUT)
            async_copy.commit_group()
            next_scale_row = scale_row
            next_ok = ok
        async_copy.wait_group(1)
        if FP8:
            gl.thread_barrier()
            _widen(_raw(stage, win_ptr.dtype.element_ty), stage, sc0, sc1, sc2, sc3, KV_C, FP8_LAYOUT, COPY_LAYOUT)
            sc0, sc1, sc2, sc3 = _load_fp8_scales(next_scale_row, next_ok, FP8_LAYOUT, COPY_LAYOUT)
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(q_smem, stage.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # Which of this tile's slots are keys: with an index list, bits read two tiles before (`_key_bits`).
        if HAS_INDICES:
            is_key = _keys_of(key_bits, offs_n)
        else:
            _, win_s, ent_s = _locate(n0 + offs_n, None, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik,
                                      HAS_ENTRIES, HAS_INDICES)
            is_key = win_s | ent_s
        # The other's tile before this one, under this tile's score product.
        if WG == 1:
            acc, m_i, l_i, s_done = _take_other_tile(
                acc, m_i, l_i, s, k_smem.index(j % 2), p_smem.index(OTHER), m_smem.index(OTHER),
                pm_bars.index(OTHER), free_bars.index(OTHER), j % 2, WG, S_LAYOUT, O_LAYOUT, HALVES_LAYOUT, BLOCK_N,
                OUT_D)
        else:
            if j > 0:
                acc, m_i, l_i, s_done = _take_other_tile(
                    acc, m_i, l_i, s, k_smem.index(2 + (j - 1) % 2), p_smem.index(OTHER), m_smem.index(OTHER),
                    pm_bars.index(OTHER), free_bars.index(OTHER), (j - 1) % 2, WG, S_LAYOUT, O_LAYOUT,
                    HALVES_LAYOUT, BLOCK_N, OUT_D)
            else:
                s_done = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        scores = gl.where(gl.expand_dims(is_key, 0), s_done * scale_log2, float("-inf"))
        m_i, l_i, alpha, p = softmax_step(scores, m_i, l_i)
        p16 = p.to(dtype)
        # The weights and maxima for the other warpgroup (which is past this warpgroup's previous ones).
        p_smem.index(WG).store(p16)
        m_smem.index(WG).store(m_i)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pm_bars.index(WG), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
        half = stage._reinterpret(dtype, [2, BLOCK_N, OUT_D], HALVES_LAYOUT).index(WG)
        acc = warpgroup_mma(gl.convert_layout(p16, P_LAYOUT), half, acc, is_async=True)
        # Where this warpgroup's tile after next sits (its tables read under this product and the next tile's
        # wait for the other): the next iteration copies it.
        row, ok, scale_row, rope_row = _tile_rows(n0 + 4 * BLOCK_N, offs_c, ids, end, n_win, win_start, n_ent,
                                                  entry_count, idx_row, s_ik, win_ptr, ent_ptr, ws_ptr, es_ptr,
                                                  wr_ptr, er_ptr, bt_row, et_row, s_btw, s_etw, s_wn, s_wb, s_en,
                                                  s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb,
                                                  PAGE, ENTRY_PAGE, HAS_ENTRIES, HAS_INDICES, FP8)
        if HAS_INDICES:
            key_bits = next_bits
            next_bits = _key_bits(n0 + 4 * BLOCK_N, end, n_win, win_start, n_ent, entry_count, idx_row, s_ik,
                                  BLOCK_N, HAS_ENTRIES, HAS_INDICES)
            if IDS_AHEAD:
                ids = _entry_ids(n0 + 6 * BLOCK_N + offs_c, end, n_win, n_ent, idx_row, s_ik)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    # The split's last tile, where it is the other's.
    if (num_tiles > 0) & ((num_tiles - 1) % 2 == OTHER):
        jo = (num_tiles - 1) // 2
        acc, m_i, l_i, _ = _take_other_tile(acc, m_i, l_i, s_zero, k_smem.index(2 * OTHER + jo % 2),
                                            p_smem.index(OTHER), m_smem.index(OTHER), pm_bars.index(OTHER),
                                            free_bars.index(OTHER), jo % 2, WG, S_LAYOUT, O_LAYOUT,
                                            HALVES_LAYOUT, BLOCK_N, OUT_D)
    async_copy.wait_group(0)

    # Both warpgroups end on the same maxima; the sums are each one's own tiles'.
    l_smem.index(WG).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(end_bar, count=1)
    mbarrier.wait(end_bar, 0)
    l_i = l_i + l_smem.index(OTHER).load(gl.SliceLayout(1, S_LAYOUT))
    heads_s = head_group * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
    real_s = heads_s < num_heads
    if FOLD_SINK:
        sink = gl.load(sink_ptr + heads_s * s_sink, mask=real_s, other=0.0).to(gl.float32) * LOG2E
        m_f = gl.maximum(m_i, sink)
        shift_f = gl.where(m_f == float("-inf"), 0.0, m_f)
        alpha_f = gl.exp2(m_i - shift_f)
        l_i = l_i * alpha_f + gl.exp2(sink - shift_f)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha_f, gl.SliceLayout(1, O_LAYOUT)), 1)
        m_i = shift_f
    else:
        m_i = gl.where(m_i == float("-inf"), 0.0, m_i)
    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, 1.0)
    if WG == 0:
        lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        gl.store(pl_ptr + t64 * s_plt + heads_s * s_plh + split * s_pls, lse, mask=real_s)
    # This warpgroup's columns, through its own two stages (no product reads them any more), in 16-byte runs.
    o_buf = k_smem._reinterpret(gl.float32, [2, BLOCK_M, OUT_D], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).index(WG)
    o_buf.store(acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, O_LAYOUT)), 1))
    gl.thread_barrier()
    CHUNK: gl.constexpr = 64
    chunk_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    heads_k = head_group * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, chunk_layout))
    cols_k = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_layout))
    po_rows = gl.expand_dims(po_ptr + t64 * s_pot + heads_k.to(gl.int64) * s_poh + split * s_pos, 1)
    for c in gl.static_range(OUT_D // CHUNK):
        o_c = o_buf.slice(c * CHUNK, CHUNK, dim=1).load(chunk_layout)
        gl.store(po_rows + gl.expand_dims((WG * OUT_D + c * CHUNK + cols_k) * s_pod, 0),
                 o_c.to(po_ptr.dtype.element_ty), mask=gl.expand_dims(heads_k < num_heads, 1))


# The split count and lengths follow the batch (eager steps vary them): as specialised ints they would
# compile a kernel per value (the twin's list).
@gluon.jit(do_not_specialize=["num_splits", "window", "rate", "entry_k", "entry_capacity", "s_plh"])
def _window_entry_split_kernel(
    q_ptr, win_ptr, bt_ptr, klen_ptr, ent_ptr, et_ptr, idx_ptr, sink_ptr, po_ptr, pl_ptr,
    ws_ptr, es_ptr, wr_ptr, er_ptr,
    num_heads, num_splits, window, rate, entry_k, entry_capacity, scale_log2, s_sink,
    s_qt, s_qh, s_qd,
    s_wn, s_wb, s_wd,
    s_btt, s_btw,
    s_en, s_eb, s_ed,
    s_ett, s_etw, s_it, s_ik,
    s_pot, s_poh, s_pos, s_pod,
    s_plt, s_plh, s_pls,
    s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_TILE: gl.constexpr,
    PAGE: gl.constexpr, ENTRY_PAGE: gl.constexpr, HAS_ENTRIES: gl.constexpr, HAS_INDICES: gl.constexpr,
    FOLD_SINK: gl.constexpr, GDC: gl.constexpr, FP8: gl.constexpr, KV_C: gl.constexpr,
    WORKER_WARPS: gl.constexpr, WORKER_REGISTERS: gl.constexpr, SHARED_SCORES: gl.constexpr,
):
    # Program (row t, head group, output half) along axis 0, the programs of a row neighbours (they read the
    # same keys while they are in L2); split along axis 1.
    BLOCK_M: gl.constexpr = 64
    OUT_D: gl.constexpr = HEAD_DIM // 2
    head_groups = gl.cdiv(num_heads, BLOCK_M)
    pid = gl.program_id(0)
    if SHARED_SCORES:
        d_part = pid * 0
        t = pid // head_groups
        head_group = pid % head_groups
    else:
        d_part = pid % 2
        t = pid // 2 // head_groups
        head_group = pid // 2 % head_groups
    split = gl.program_id(1)
    t64 = t.to(gl.int64)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem_layout)
    # Two stages a warpgroup. FP8 caches (leaves: values at win_ptr / ent_ptr, scales, RoPE values): a tile's
    # e4m3 values come as bytes into the first half of its stage and are widened there (`_widen`).
    k_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_N, HEAD_DIM], smem_layout)
    # At the end: each warpgroup's O [64, OUT_D] float32 over its two stages, warpgroup 1's (m, l) apart.
    o_smem = k_smem._reinterpret(gl.float32, [2, BLOCK_M, OUT_D], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ml_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # Both halves of Q are in (one arrival a warpgroup); warpgroup 1's state is in shared memory.
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=2)
    DONE_ARRIVALS: gl.constexpr = 2 if SHARED_SCORES else 1
    mbarrier.init(done_bar, count=DONE_ARRIVALS)

    if GDC:
        gdc_wait()
        gdc_launch_dependents()

    # The row's list: n_win window keys, then n_e entries (the twin's arithmetic, so the splits cover the
    # same slots). Entries past the table are no key (a pick there is masked, as the reference masks it).
    key_len = gl.maximum(gl.load(klen_ptr + t64), 0)
    n_win = gl.minimum(key_len, window)
    entry_count = key_len * 0
    n_ent = key_len * 0
    if HAS_ENTRIES:
        entry_count = gl.minimum(key_len // rate, entry_capacity)
        if HAS_INDICES:
            n_ent = gl.minimum(entry_count, entry_k)
        else:
            n_ent = entry_count
    total = n_win + n_ent
    # Whole runs of SPLIT_TILE slots a split, so only a split's last tile is ragged.
    per_split = gl.cdiv(gl.cdiv(total, num_splits), SPLIT_TILE) * SPLIT_TILE
    start = split * per_split
    end = gl.minimum(start + per_split, total)
    win_start = key_len - n_win
    bt_row = bt_ptr + t64 * s_btt
    et_row = et_ptr + t64 * s_ett
    idx_row = idx_ptr + t64 * s_it

    if SHARED_SCORES:
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N],
                                           gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))
        m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        pm_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        free_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(pm_bars.index(b), count=1)
            mbarrier.init(free_bars.index(b), count=1)
        gl.warp_specialize([
            (_shared_scores_tiles, (q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, p_smem, m_smem, ml_smem, pm_bars,
                                    free_bars, done_bar, win_ptr, ent_ptr, bt_row, et_row, idx_row, ws_ptr, es_ptr,
                                    wr_ptr, er_ptr, po_ptr, pl_ptr, sink_ptr, t64, head_group, split, num_heads,
                                    start, end, n_win, win_start, n_ent, entry_count, scale_log2, s_sink, s_wd,
                                    s_btw, s_etw, s_ik, s_wn, s_wb, s_en, s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn,
                                    s_wrb, s_ern, s_erb, s_pot, s_poh, s_pos, s_pod, s_plt, s_plh, s_pls, HEAD_DIM,
                                    BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES, HAS_INDICES, FOLD_SINK, FP8, KV_C, 0)),
            (_shared_scores_tiles, (q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, p_smem, m_smem, ml_smem, pm_bars,
                                    free_bars, done_bar, win_ptr, ent_ptr, bt_row, et_row, idx_row, ws_ptr, es_ptr,
                                    wr_ptr, er_ptr, po_ptr, pl_ptr, sink_ptr, t64, head_group, split, num_heads,
                                    start, end, n_win, win_start, n_ent, entry_count, scale_log2, s_sink, s_wd,
                                    s_btw, s_etw, s_ik, s_wn, s_wb, s_en, s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn,
                                    s_wrb, s_ern, s_erb, s_pot, s_poh, s_pos, s_pod, s_plt, s_plh, s_pls, HEAD_DIM,
                                    BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES, HAS_INDICES, FOLD_SINK, FP8, KV_C, 1)),
        ], [WORKER_WARPS], [WORKER_REGISTERS])
    else:
        # The same arguments for both warpgroups, written out in each tuple (a tuple built by concatenation would
        # turn the constexprs into tensors).
        gl.warp_specialize([
            (_warpgroup_tiles, (q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, o_smem, ml_smem, done_bar, win_ptr,
                                ent_ptr, bt_row, et_row, idx_row, ws_ptr, es_ptr, wr_ptr, er_ptr, po_ptr, pl_ptr,
                                sink_ptr, t64, head_group, d_part, split, num_heads, start, end, n_win, win_start,
                                n_ent, entry_count, scale_log2, s_sink, s_wd, s_btw, s_etw, s_ik, s_wn, s_wb, s_en,
                                s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, s_pot, s_poh, s_pos,
                                s_pod, s_plt, s_plh, s_pls, HEAD_DIM, BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES,
                                HAS_INDICES, FOLD_SINK, FP8, KV_C, 0)),
            (_warpgroup_tiles, (q_ptr, s_qt, s_qh, s_qd, q_bar, q_smem, k_smem, o_smem, ml_smem, done_bar, win_ptr,
                                ent_ptr, bt_row, et_row, idx_row, ws_ptr, es_ptr, wr_ptr, er_ptr, po_ptr, pl_ptr,
                                sink_ptr, t64, head_group, d_part, split, num_heads, start, end, n_win, win_start,
                                n_ent, entry_count, scale_log2, s_sink, s_wd, s_btw, s_etw, s_ik, s_wn, s_wb, s_en,
                                s_eb, s_wsn, s_wsb, s_esn, s_esb, s_wrn, s_wrb, s_ern, s_erb, s_pot, s_poh, s_pos,
                                s_pod, s_plt, s_plh, s_pls, HEAD_DIM, BLOCK_N, PAGE, ENTRY_PAGE, HAS_ENTRIES,
                                HAS_INDICES, FOLD_SINK, FP8, KV_C, 1)),
        ], [WORKER_WARPS], [WORKER_REGISTERS])


def window_entry_split(q: torch.Tensor, window_cache: torch.Tensor, block_table: torch.Tensor,
                       key_lens: torch.Tensor, entry_cache: torch.Tensor, entry_table: torch.Tensor,
                       entry_indices: torch.Tensor, sinks: torch.Tensor, partial_out: torch.Tensor,
                       partial_lse: torch.Tensor, *, softmax_scale_log2: float, sliding_window: int,
                       compress_rate: int, has_entries: bool, has_indices: bool, fold_sink: bool, d_split: int,
                       use_pdl: bool, fp8_leaves: tuple[torch.Tensor, ...] | None = None) -> None:
    """Stage 1 of `triton.v4_attention.window_entry_attention` on the warpgroup MMA: `_v4_split_kernel`'s tensors.

    q [n, H, D] bf16/fp16 (any strides; copied whole if cp.async cannot gather its rows); window_cache
    [nb, bs, D] through block_table [n, W] int32; key_lens [n] int32; entry_cache [nbg, bsg, D] through
    entry_table [n, Wg] int32, entry_indices [n, k] int32 (without entries / indices: the window's tensors
    stand in, never read); sinks [H]; partial_out [n, H, S, D] and partial_lse [n, H, S] (or, fold_sink with
    S == 1, the outputs viewed as one split) are written: split s of row t covers its virtual key slots
    [s * k, min((s + 1) * k, total)), k = total / S rounded up to whole 64-key tiles (the twin's splits).
    softmax_scale_log2 = softmax_scale * log2(e). d_split: programs a (row, head group, split): D_SPLIT = 2
    (each the scores and half the output columns) or 1 (the scores once, both halves). FP8 caches:
    window_cache / entry_cache are their values [.., C] float8_e4m3fn (C = FP8_KV_C), and fp8_leaves =
    (window scales, entry scales, window rope, entry rope) [.., 4] float32 and [.., D - C] in q's dtype, each
    leaf's rows contiguous; the keys are the dequantized rows. Raises ValueError for what the kernel cannot take.
    """
    num_rows, num_heads, head_dim = q.shape
    if not applies(num_heads, head_dim, q.dtype, q.device):
        raise ValueError(f"window_entry_split: {num_heads} heads of {head_dim} in {q.dtype} on {q.device}; the "
                         f"kernel takes >= {BLOCK_M} heads of {HEAD_DIM} in bf16 / fp16 on a Hopper GPU")
    if not copyable(window_cache, entry_cache, *(fp8_leaves or ())[2:]):
        raise ValueError("window_entry_split: the caches need 16-byte aligned contiguous rows for cp.async")
    kv_c = head_dim
    if fp8_leaves is not None:
        kv_c = window_cache.shape[2]
        if kv_c != FP8_KV_C or any(t.stride(2) != 1 for t in fp8_leaves):
            raise ValueError(f"window_entry_split: FP8 caches of {kv_c} values a key (feature strides "
                             f"{[t.stride(2) for t in fp8_leaves]}); the kernel takes {FP8_KV_C}, contiguous")
    if entry_cache.stride(2) != window_cache.stride(2):
        raise ValueError(f"window_entry_split: entry_cache's feature stride {entry_cache.stride(2)} differs from "
                         f"window_cache's {window_cache.stride(2)}")
    if d_split not in (1, D_SPLIT):
        raise ValueError(f"window_entry_split: d_split {d_split}; the kernel runs 1 or {D_SPLIT} programs a row "
                         f"and head group")
    splits = partial_out.shape[2]
    if fold_sink and splits != 1:
        raise ValueError(f"window_entry_split: fold_sink needs one split, got {splits}")
    if num_rows == 0:
        return
    q = q if copyable(q) else q.contiguous()
    grid = (num_rows * triton.cdiv(num_heads, BLOCK_M) * d_split, splits)
    _window_entry_split_kernel[grid](
        q, window_cache, block_table, key_lens, entry_cache, entry_table, entry_indices, sinks,
        partial_out, partial_lse, *(fp8_leaves or (window_cache,) * 4),
        num_heads, splits, sliding_window, max(1, compress_rate), entry_indices.shape[1],
        entry_table.shape[1] * entry_cache.shape[1], softmax_scale_log2, sinks.stride(0),
        *q.stride(), *window_cache.stride(), *block_table.stride(), *entry_cache.stride(), *entry_table.stride(),
        *entry_indices.stride(), *partial_out.stride(), *partial_lse.stride(),
        *(s for t in (fp8_leaves or (window_cache,) * 4) for s in t.stride()[:2]),
        HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, SPLIT_TILE=SPLIT_TILE,
        PAGE=window_cache.shape[1], ENTRY_PAGE=entry_cache.shape[1], HAS_ENTRIES=has_entries,
        HAS_INDICES=has_entries and has_indices, FOLD_SINK=fold_sink, GDC=use_pdl, FP8=fp8_leaves is not None,
        KV_C=kv_c, WORKER_WARPS=WARPGROUP_WARPS, WORKER_REGISTERS=WARPGROUP_REGISTERS, SHARED_SCORES=d_split == 1,
        num_warps=WARPGROUP_WARPS, maxnreg=WARPGROUP_REGISTERS, launch_pdl=use_pdl,
    )
