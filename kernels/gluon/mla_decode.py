"""Absorbed MLA decode on Hopper's warpgroup MMA: 64 query rows a program, keys in shared memory.

At 128 heads (every DeepSeek model under data-parallel attention) the decode is compute-bound:
2 H (2C + R) flops a key against (C + R) x 2 bytes, 242 flops a byte at H = 128, C = 512, R = 64.
The `tl.dot` twin (`triton.decode._chunked_split_kernel`) multiplies tiles it holds in registers;
here the queries and two stages of key tiles stay in shared memory, `wgmma` reads them from there,
and `cp.async` gathers the next tile's rows through the block table while the current one is
multiplied. One program: 64 rows (heads, or 64 consecutive head-major (head, query) pairs when a sequence
has q_len > 1 queries: 128 heads x 3 queries fill six programs, where the twin's whole heads a program
take seven) of one sequence over one split of its keys, eight warps as two warpgroups. For each 64-key tile:

    S [64, 64]  = Q_nope K_nope^T + Q_pe K_pe^T   both from shared memory; a warpgroup takes 32 keys
    online softmax over S in registers (base 2, -inf past the split or a query's causal end)
    O [64, C]  += P K_nope                         P from registers; a warpgroup takes C / 2 columns

Shared memory holds Q (64 x 576) and two key stages (64 x 576 each), bf16: 216 KiB of the 227 KiB
a Hopper block may take, so one program runs on a multiprocessor at a time. Its output is the
twin's split partials (normalised output and natural-log LSE), merged by `decode_merge`.

Over an FP8 latent cache (`FP8LatentCache`, FP8 constexpr) a tile's e4m3 values come by `cp.async` as
bytes into the first half of their stage, its RoPE values into their own stage as before, and its four
group scales into registers with the copy. Before the score product every thread reads its share of
the bytes, all threads meet, and each writes its values times their scale in float32, rounded once to
the queries' dtype, over the whole stage (`_widen`): the rows `FP8LatentCache.rows` gives, so the outputs
equal the kernel's over those rows as a plain cache bit for bit, in the same shared memory. The widening
runs while the previous tile's value product is still on the tensor cores.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .support import available

# Rows a program, keys a tile, and the column slab one copy or one shared-memory slice covers (the
# 128-byte swizzle of 16-bit values).
BLOCK_M = 64
BLOCK_N = 64
_SLAB = 64
NUM_WARPS = 8
# The shapes the kernel's tiles are laid out for: DeepSeek's latent and RoPE widths.
KV_LORA_RANK = 512
ROPE_DIM = 64


def applies(num_heads: int, q_len: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
            device: torch.device) -> bool:
    """Whether the kernel takes a decode: 16-bit queries over a cache of DeepSeek's widths (C = 512,
    R = 64; plain or FP8) on a Hopper GPU, with at least BLOCK_M rows (heads x queries) a
    sequence to fill a program (at 16 heads and one query the twin's narrower programs stream the cache
    faster)."""
    return (dtype in (torch.bfloat16, torch.float16) and kv_lora_rank == KV_LORA_RANK
            and rope_dim == ROPE_DIM and num_heads * q_len >= BLOCK_M and available(device))


def row_groups(num_heads: int, q_len: int) -> int:
    """Programs a sequence (and split): its num_heads x q_len (head, query) rows, BLOCK_M a program."""
    return -(-num_heads * q_len // BLOCK_M)


def copyable(*tensors: torch.Tensor) -> bool:
    """Whether `cp.async` can gather the rows of these tensors (cache views [nb, bs, cols], queries [rows, H,
    C + R]): contiguous columns and 16-byte aligned rows (its copies are 4, 8 or 16 bytes; the kernel's, 16)."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


@gluon.jit
def _locate(slot, end, idx_row, num_positions, s_ik, SPARSE: gl.constexpr):
    # (cache position, valid) of key slots `slot`: the slots themselves over a sequence's keys [.., end),
    # or, SPARSE, the positions a row's index list holds at them (-1, or past the table: not a key).
    if SPARSE:
        pos = gl.load(idx_row + slot * s_ik, mask=slot < end, other=-1)
        valid = (pos >= 0) & (pos < num_positions)
    else:
        pos = slot
        valid = slot < end
    return gl.where(valid, pos, 0), valid


@gluon.jit
def _pages(pos, valid, bt_row, s_btw, PAGE_SIZE: gl.constexpr):
    # (page, in-page offset) of cache positions `pos`: the block-table read a later copy waits on.
    page = gl.load(bt_row + (pos // PAGE_SIZE) * s_btw, mask=valid, other=0).to(gl.int64)
    return page, (pos % PAGE_SIZE).to(gl.int64)


@gluon.jit
def _copy_rows(nope_buf, pe_buf, nope_rows, pe_rows, mask, s_nope, s_pe, KV_LORA_RANK: gl.constexpr,
               SLAB: gl.constexpr, layout: gl.constexpr):
    # Starts copying rows [N] (pointers [N, 1] in `layout`) into a [N, C] and a [N, R] buffer, a slab of
    # SLAB columns a copy; rows not in `mask` [N, 1] are zero-filled, so a product over them is 0, never NaN.
    cols = gl.arange(0, SLAB, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(KV_LORA_RANK // SLAB):
        async_copy.async_copy_global_to_shared(nope_buf.slice(c * SLAB, SLAB, dim=1),
                                               nope_rows + gl.expand_dims((c * SLAB + cols) * s_nope, 0), mask)
    async_copy.async_copy_global_to_shared(pe_buf, pe_rows + gl.expand_dims(cols * s_pe, 0), mask)


@gluon.jit
def _copy_keys(nope_buf, pe_buf, v_ptr, r_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_rn, s_rb, s_rd,
               KV_LORA_RANK: gl.constexpr, SLAB: gl.constexpr, layout: gl.constexpr):
    # Starts copying the latent rows at (page, offset) [BLOCK_N] (SliceLayout(1, layout)) into one stage.
    _copy_rows(nope_buf, pe_buf, gl.expand_dims(v_ptr + page * s_vn + offset * s_vb, 1),
               gl.expand_dims(r_ptr + page * s_rn + offset * s_rb, 1), gl.expand_dims(valid, 1), s_vd, s_rd,
               KV_LORA_RANK, SLAB, layout)


@gluon.jit
def copy_fp8_half(buf, half: gl.constexpr, v_ptr, page, offset, valid, s_vn, s_vb, s_vd, KV_LORA_RANK: gl.constexpr,
                  fp8_layout: gl.constexpr):
    """Starts copying half `half` (0: columns 0 .. C / 2, 1: the rest) of an FP8 cache's e4m3 values of the rows at
    (page, offset) [BLOCK_N] (SliceLayout(1, fp8_layout)) as bytes into buf [BLOCK_N, C / 2], 16 values a copy;
    rows not in `valid` are zero-filled (0 x their scale, also loaded as 0, is 0)."""
    GROUP: gl.constexpr = 128
    HALF_GROUPS: gl.constexpr = KV_LORA_RANK // GROUP // 2
    rows = gl.expand_dims(v_ptr + page * s_vn + offset * s_vb, 1)
    mask = gl.expand_dims(valid, 1)
    cols = gl.arange(0, GROUP, layout=gl.SliceLayout(0, fp8_layout))
    for g in gl.static_range(HALF_GROUPS):
        async_copy.async_copy_global_to_shared(buf.slice(g * GROUP, GROUP, dim=1),
                                               rows + gl.expand_dims(((half * HALF_GROUPS + g) * GROUP + cols) * s_vd,
                                                                     0), mask)


@gluon.jit
def copy_rope(pe_buf, r_ptr, page, offset, valid, s_rn, s_rb, s_rd, ROPE_DIM: gl.constexpr, copy_layout: gl.constexpr):
    """Starts copying the RoPE values of the rows at (page, offset) [BLOCK_N] (any layout) into pe_buf [BLOCK_N, R];
    rows not in `valid` are zero-filled."""
    row_layout: gl.constexpr = gl.SliceLayout(1, copy_layout)
    pe_rows = gl.convert_layout(r_ptr + page * s_rn + offset * s_rb, row_layout)
    pe_cols = gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, copy_layout))
    async_copy.async_copy_global_to_shared(pe_buf, gl.expand_dims(pe_rows, 1) + gl.expand_dims(pe_cols * s_rd, 0),
                                           gl.expand_dims(gl.convert_layout(valid, row_layout), 1))


@gluon.jit
def _copy_fp8_keys(raw_buf, pe_buf, v_ptr, r_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_rn, s_rb, s_rd,
                   KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, fp8_layout: gl.constexpr,
                   copy_layout: gl.constexpr):
    # Starts copying an FP8 cache's rows at (page, offset) [BLOCK_N] (SliceLayout(1, fp8_layout)) into one
    # stage: their e4m3 values as bytes into raw_buf [BLOCK_N, C] (`copy_fp8_half`), and their RoPE values
    # into pe_buf [BLOCK_N, R]; masked rows are zero-filled.
    HALF: gl.constexpr = KV_LORA_RANK // 2
    copy_fp8_half(raw_buf.slice(0, HALF, dim=1), 0, v_ptr, page, offset, valid, s_vn, s_vb, s_vd, KV_LORA_RANK,
                  fp8_layout)
    copy_fp8_half(raw_buf.slice(HALF, HALF, dim=1), 1, v_ptr, page, offset, valid, s_vn, s_vb, s_vd, KV_LORA_RANK,
                  fp8_layout)
    copy_rope(pe_buf, r_ptr, page, offset, valid, s_rn, s_rb, s_rd, ROPE_DIM, copy_layout)


@gluon.jit
def load_scales(sc_ptr, page, offset, valid, s_scn, s_scb, s_scd):
    """The four group scales [BLOCK_N] each of an FP8 cache's rows at (page, offset), in their layout; 0 for
    rows not in `valid`."""
    rows = sc_ptr + page * s_scn + offset * s_scb
    return (gl.load(rows, mask=valid, other=0.0), gl.load(rows + s_scd, mask=valid, other=0.0),
            gl.load(rows + 2 * s_scd, mask=valid, other=0.0), gl.load(rows + 3 * s_scd, mask=valid, other=0.0))


@gluon.jit
def _widen(k_nope, stage, sc0, sc1, sc2, sc3, fp8_layout: gl.constexpr):
    # Dequantizes stage `stage` of k_nope [2, BLOCK_N, 512] in place: the e4m3 values `copy_tile` put in the
    # stage's first half times their group's scale [BLOCK_N] in float32, rounded once to k_nope's dtype, over
    # the whole stage: the rows `FP8LatentCache.rows` gives. Every thread reads its values before any thread
    # writes, since the two views share bytes.
    GROUP: gl.constexpr = 128
    BLOCK_N: gl.constexpr = k_nope.shape[1]
    KV_LORA_RANK: gl.constexpr = k_nope.shape[2]
    raw = k_nope._reinterpret(gl.float8e4nv, [2, 2 * BLOCK_N, KV_LORA_RANK],
                              gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).index(stage).slice(0, BLOCK_N, dim=0)
    keys = k_nope.index(stage)
    f0 = raw.slice(0, GROUP, dim=1).load(fp8_layout)
    f1 = raw.slice(GROUP, GROUP, dim=1).load(fp8_layout)
    f2 = raw.slice(2 * GROUP, GROUP, dim=1).load(fp8_layout)
    f3 = raw.slice(3 * GROUP, GROUP, dim=1).load(fp8_layout)
    gl.thread_barrier()
    dtype: gl.constexpr = keys.dtype
    keys.slice(0, GROUP, dim=1).store((f0.to(gl.float32) * gl.expand_dims(sc0, 1)).to(dtype))
    keys.slice(GROUP, GROUP, dim=1).store((f1.to(gl.float32) * gl.expand_dims(sc1, 1)).to(dtype))
    keys.slice(2 * GROUP, GROUP, dim=1).store((f2.to(gl.float32) * gl.expand_dims(sc2, 1)).to(dtype))
    keys.slice(3 * GROUP, GROUP, dim=1).store((f3.to(gl.float32) * gl.expand_dims(sc3, 1)).to(dtype))


@gluon.jit
def copy_tile(k_nope, k_pe, stage, v_ptr, sc_ptr, r_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_scn, s_scb, s_scd,
              s_rn, s_rb, s_rd, sc0, sc1, sc2, sc3, KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr,
              FP8: gl.constexpr, fp8_layout: gl.constexpr, copy_layout: gl.constexpr):
    """Starts copying the latent rows at (page, offset) [BLOCK_N] (SliceLayout(1, copy_layout)) into stage
    `stage` of k_nope [2, BLOCK_N, C] and k_pe [2, BLOCK_N, R]; masked rows are zero-filled. FP8: the e4m3 values
    as bytes into the stage's first half (`_copy_fp8_keys`, for `_widen`), and returns the rows' four group
    scales (`load_scales`, SliceLayout(1, fp8_layout)); otherwise returns sc0..sc3 as given."""
    SLAB: gl.constexpr = 64
    if FP8:
        BLOCK_N: gl.constexpr = k_nope.shape[1]
        raw = k_nope._reinterpret(gl.float8e4nv, [2, 2 * BLOCK_N, KV_LORA_RANK],
                                  gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rows: gl.constexpr = gl.SliceLayout(1, fp8_layout)
        page8 = gl.convert_layout(page, rows)
        offset8 = gl.convert_layout(offset, rows)
        valid8 = gl.convert_layout(valid, rows)
        _copy_fp8_keys(raw.index(stage).slice(0, BLOCK_N, dim=0), k_pe.index(stage), v_ptr, r_ptr, page8, offset8,
                       valid8, s_vn, s_vb, s_vd, s_rn, s_rb, s_rd, KV_LORA_RANK, ROPE_DIM, fp8_layout, copy_layout)
        sc0, sc1, sc2, sc3 = load_scales(sc_ptr, page8, offset8, valid8, s_scn, s_scb, s_scd)
    else:
        _copy_keys(k_nope.index(stage), k_pe.index(stage), v_ptr, r_ptr, page, offset, valid, s_vn, s_vb, s_vd, s_rn,
                   s_rb, s_rd, KV_LORA_RANK, SLAB, copy_layout)
    return sc0, sc1, sc2, sc3


@gluon.jit
def softmax_step(scores, m_i, l_i):
    """One tile's online-softmax update: scores [M, N] (base 2, -inf where a slot is no key), the running maxima
    m_i and sums l_i [M] (SliceLayout(1, scores' layout)) -> (m, l, alpha, p): the new maxima and sums, the factor
    alpha [M] that rescales the output so far, and the weights p [M, N]."""
    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
    # A row may see no key of a tile (or of its split) yet: shift by 0 then, so weights are 0.
    shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - shift)
    p = gl.exp2(scores - gl.expand_dims(shift, 1))
    return m_new, l_i * alpha + gl.sum(p, axis=1), alpha, p


@gluon.jit
def store_through_stage(stage, out, row_ptrs, row_mask, col0, s_col, COLS: gl.constexpr, layout: gl.constexpr):
    """Stores out [M, COLS] (in the product's layout, already in the output's dtype) at row_ptrs [M, 1] +
    (col0 + j) * s_col, j < COLS, rows where row_mask [M, 1] (both in `layout`), through `stage`: a shared
    buffer [M, >= COLS] of that dtype that no product reads any more. From there a thread stores 16-byte runs
    (`layout`'s), whole sectors a store, where the product's layout holds 4-byte pairs."""
    SLAB: gl.constexpr = 64   # a slice of the 128-byte swizzle: 64 16-bit values
    gl.thread_barrier()
    staged = stage.slice(0, COLS, dim=1)
    staged.store(out)
    gl.thread_barrier()
    cols = gl.arange(0, SLAB, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(COLS // SLAB):
        gl.store(row_ptrs + gl.expand_dims((col0 + c * SLAB + cols) * s_col, 0),
                 staged.slice(c * SLAB, SLAB, dim=1).load(layout), mask=row_mask)


@gluon.jit
def _program_rows(b, row_group, num_heads, Q_LEN: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    # (q row, head, row is real, query index) of the program's BLOCK_M rows, in `layout` [BLOCK_M]: rows
    # [row_group * BLOCK_M, ..) of sequence b's head-major (head, query) pairs, so that every program but
    # the last is full whatever Q_LEN (a head's queries may fall in two programs: each row is its own).
    r = row_group * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
    query = r % Q_LEN
    heads = r // Q_LEN
    return b.to(gl.int64) * Q_LEN + query, heads, heads < num_heads, query


# The split count follows the batch size, and top_k and the table's width the model: as specialised ints
# they would compile a kernel per value.
@gluon.jit(do_not_specialize=["num_splits", "top_k", "num_positions", "s_plh"])
def _wgmma_split_kernel(
    q_ptr, v_ptr, sc_ptr, r_ptr, bt_ptr, seq_lens_ptr, idx_ptr, po_ptr, pl_ptr,
    num_heads, num_splits, top_k, num_positions, scale_log2, s_sl,
    s_qb, s_qh, s_qd,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_btb, s_btw, s_it, s_ik,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    KV_LORA_RANK: gl.constexpr, ROPE_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
    Q_LEN: gl.constexpr, SPARSE: gl.constexpr, STAGED_OUT: gl.constexpr, FP8: gl.constexpr,
):
    # Dense: program (row group, sequence b, split) over the split's share of b's keys. SPARSE: program
    # (row group, row b, split) over the split's share of the top_k slots of b's index list (Q_LEN 1).
    BLOCK_M: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    SLAB: gl.constexpr = 64
    LN2: gl.constexpr = 0.6931471805599453
    # The row groups of one sequence are neighbours in the grid, so they read its keys while the others'
    # copy is still in L2.
    row_group = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # Copies: 16 bytes a thread, a warp 4 rows x 64 columns.
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    # Scores: the two warpgroups take 32 keys each; output: C / 2 columns each (wgmma's N).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, KV_LORA_RANK // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_M, KV_LORA_RANK], smem_layout)
    q_pe = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE_DIM], smem_layout)
    k_nope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA_RANK], smem_layout)
    k_pe = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE_DIM], smem_layout)
    # FP8: a tile's e4m3 values come by cp.async, 16 a copy, into the first half of its stage's bytes, and
    # are widened from there into the whole stage (`copy_tile`, `_widen`): no more shared memory than 16 bits.
    fp8_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
    fp8_rows: gl.constexpr = gl.SliceLayout(1, fp8_layout)

    if SPARSE:
        slots = top_k
        seq_len = num_positions         # no causal bound past the index list's own
    else:
        seq_len = gl.load(seq_lens_ptr + b * s_sl)
        slots = seq_len
    # Whole tiles a split, so only a split's last tile is ragged.
    slots_per_split = gl.cdiv(gl.cdiv(slots, num_splits), BLOCK_N) * BLOCK_N
    start = split * slots_per_split
    end = gl.minimum(start + slots_per_split, slots)
    bt_row = bt_ptr + b.to(gl.int64) * s_btb
    idx_row = idx_ptr + b.to(gl.int64) * s_it
    offs_copy = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    # A tile's rows are located two tiles ahead (index list, then block table, a loop iteration apart), so
    # no copy waits on a load: the loads for tile t + 2 and t + 3 are in flight while tile t is multiplied.
    pos, valid = _locate(start + offs_copy, end, idx_row, num_positions, s_ik, SPARSE)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    # The queries and the first tile come in one copy group, every copy in flight at once.
    rows, heads, real, _ = _program_rows(b, row_group, num_heads, Q_LEN, BLOCK_M, gl.SliceLayout(1, copy_layout))
    q_rows = gl.expand_dims(q_ptr + rows * s_qb + heads * s_qh, 1)
    _copy_rows(q_nope, q_pe, q_rows, q_rows + KV_LORA_RANK * s_qd, gl.expand_dims(real, 1), s_qd, s_qd,
               KV_LORA_RANK, SLAB, copy_layout)
    # The group scales of the tile being widened, loaded with its copy (FP8 only; zeros otherwise, unused).
    sc0 = gl.zeros([BLOCK_N], gl.float32, layout=fp8_rows)
    sc1 = sc0
    sc2 = sc0
    sc3 = sc0
    sc0, sc1, sc2, sc3 = copy_tile(k_nope, k_pe, 0, v_ptr, sc_ptr, r_ptr, page, offset, valid, s_vn, s_vb, s_vd,
                                   s_scn, s_scb, s_scd, s_rn, s_rb, s_rd, sc0, sc1, sc2, sc3, KV_LORA_RANK, ROPE_DIM,
                                   FP8, fp8_layout, copy_layout)
    async_copy.commit_group()
    pos, valid = _locate(start + BLOCK_N + offs_copy, end, idx_row, num_positions, s_ik, SPARSE)
    page, offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
    copy_valid = valid
    pos, valid = _locate(start + 2 * BLOCK_N + offs_copy, end, idx_row, num_positions, s_ik, SPARSE)

    # Query j of a sequence stands at seq_len - Q_LEN + j and sees the keys before seq_len - Q_LEN + j + 1
    # (SPARSE: one query, and every valid position is below seq_len).
    _, _, _, query_s = _program_rows(b, row_group, num_heads, Q_LEN, BLOCK_M,
                                     gl.SliceLayout(1, s_layout))
    key_end = gl.expand_dims(seq_len - (Q_LEN - 1 - query_s), 1)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # Tile t's positions as the scores lay them out, read a tile ahead too.
    pos_s, valid_s = _locate(start + offs_n, end, idx_row, num_positions, s_ik, SPARSE)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, KV_LORA_RANK], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    # Tile t - 1's value product is still running when iteration t starts: its locating work and the
    # wait for tile t's copy overlap it, and tile t's score product queues right behind it on the tensor
    # cores. Tile t + 1's copy then goes into tile t - 1's stage once both products are done.
    for t in range(num_tiles):
        stage = t % 2
        n0 = start + t * BLOCK_N
        next_page, next_offset = _pages(pos, valid, bt_row, s_btw, PAGE_SIZE)
        next_valid = valid
        pos, valid = _locate(n0 + 3 * BLOCK_N + offs_copy, end, idx_row, num_positions, s_ik, SPARSE)
        next_pos_s, next_valid_s = _locate(n0 + BLOCK_N + offs_n, end, idx_row, num_positions, s_ik, SPARSE)
        # Tile t's copies (and, the first time, the queries') are done in this thread, made visible to the
        # tensor cores' proxy, then done in every thread.
        async_copy.wait_group(0)
        if FP8:
            # Every thread's copy is in before any thread widens (the widened tile is written to shared
            # memory by the threads, hence the fence before the tensor cores read it).
            gl.thread_barrier()
            _widen(k_nope, stage, sc0, sc1, sc2, sc3, fp8_layout)
        fence_async_shared()
        gl.thread_barrier()

        keys = k_nope.index(stage)
        s = warpgroup_mma(q_nope, keys.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, k_pe.index(stage).permute((1, 0)), s, is_async=True)
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
        # Every warp is past its products over tile t - 1's stage: tile t + 1's copy may overwrite it.
        gl.thread_barrier()
        sc0, sc1, sc2, sc3 = copy_tile(k_nope, k_pe, 1 - stage, v_ptr, sc_ptr, r_ptr, page, offset, copy_valid,
                                       s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd, sc0, sc1, sc2, sc3,
                                       KV_LORA_RANK, ROPE_DIM, FP8, fp8_layout, copy_layout)
        async_copy.commit_group()
        page, offset, copy_valid = next_page, next_offset, next_valid

        if SPARSE:
            # Every valid position is below the table's end already (`_locate`): no causal bound to apply.
            # Leaving the positions out frees their registers: 1.5-2% of the sparse kernel. (The mask is
            # broadcast to the tile's rows by an always-true row term: as a [1, N] mask it spilled.)
            visible = gl.expand_dims(valid_s, 0) & (key_end >= 0)
        else:
            visible = gl.expand_dims(valid_s, 0) & (gl.expand_dims(pos_s, 0) < key_end)
        pos_s = next_pos_s
        valid_s = next_valid_s
        m_i, l_i, alpha, p = softmax_step(gl.where(visible, s * scale_log2, float("-inf")), m_i, l_i)

        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), keys, acc, is_async=True)
        # Returns at once (the product stays in flight; the next score product's wait retires it) and keeps
        # acc one type around the loop.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    async_copy.wait_group(0)

    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    rows_s, heads_s, real_s, _ = _program_rows(b, row_group, num_heads, Q_LEN, BLOCK_M,
                                               gl.SliceLayout(1, s_layout))
    gl.store(pl_ptr + rows_s * s_plb + heads_s * s_plh + split * s_pls, lse, mask=real_s)

    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    if STAGED_OUT:
        # Outputs in q's dtype go through a key stage (both are free now): 2-3% of the kernel at 32 tiles a
        # program (bench/notes/kernels.md).
        rows_c, heads_c, real_c, _ = _program_rows(b, row_group, num_heads, Q_LEN, BLOCK_M,
                                                   gl.SliceLayout(1, copy_layout))
        store_through_stage(k_nope.index(0), out.to(dtype),
                            gl.expand_dims(po_ptr + rows_c * s_pob + heads_c * s_poh + split * s_pos, 1),
                            gl.expand_dims(real_c, 1), 0, s_pod, KV_LORA_RANK, copy_layout)
    else:
        rows_o, heads_o, real_o, _ = _program_rows(b, row_group, num_heads, Q_LEN, BLOCK_M,
                                                   gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, o_layout))
        po_rows = gl.expand_dims(po_ptr + rows_o * s_pob + heads_o * s_poh + split * s_pos, 1)
        gl.store(po_rows + gl.expand_dims(cols_o * s_pod, 0), out.to(po_ptr.dtype.element_ty),
                 mask=gl.expand_dims(real_o, 1))


def wgmma_split_decode(q: torch.Tensor, values: torch.Tensor, rope: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor, *,
                       softmax_scale_log2: float, q_len: int, scales: torch.Tensor | None = None) -> None:
    """Stage 1 of the split decode (`triton.decode.mla_decode`) on the warpgroup MMA.

    q [B * q_len, H, C + R] bf16/fp16 (any strides); values [nb, bs, C] and rope [nb, bs, R] (a plain cache's two
    views, in q's dtype), or an FP8 cache's leaves: values [nb, bs, C] float8_e4m3fn, scales [nb, bs, C / 128]
    float32 and rope [nb, bs, R] in q's dtype (the keys are its dequantized rows); block_table [B, W] int32; seq_lens [B] int32; partial_out [B * q_len, H, S, C]
    and partial_lse [B * q_len, H, S] (float32 partials, or the outputs viewed as one split) are written:
    split s of sequence b covers its keys [s * k, min((s + 1) * k, seq_lens[b])), k = seq_lens[b] / S
    rounded up to whole 64-key tiles. Shapes are the caller's to check (`applies`, `copyable`, `mla_decode`).
    """
    num_seqs = q.shape[0] // q_len
    _launch(q, values, scales, rope, block_table, seq_lens, seq_lens.stride(0), block_table, (0, 0), 0,
            partial_out, partial_lse, num_seqs, softmax_scale_log2, q_len, sparse=False)


def wgmma_sparse_split_decode(q: torch.Tensor, values: torch.Tensor, rope: torch.Tensor, block_table: torch.Tensor,
                              indices: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor, *,
                              softmax_scale_log2: float, scales: torch.Tensor | None = None) -> None:
    """Stage 1 of the sparse decode (`triton.dsa_decode.sparse_mla_decode`) on the warpgroup MMA.

    q [T, H, C + R] bf16/fp16; values / rope (/ scales) as `wgmma_split_decode`'s; block_table [T, W] int32; indices
    [T, k] int32 positions into row t's table (-1, or any outside [0, W * bs): none); partial_out [T, H, S,
    C] and partial_lse [T, H, S] are written: split s of row t covers its index slots [s * j, min((s + 1) *
    j, k)), j = k / S rounded up to whole 64-slot tiles.
    """
    _launch(q, values, scales, rope, block_table, block_table, 0, indices, tuple(indices.stride()), indices.shape[1],
            partial_out, partial_lse, q.shape[0], softmax_scale_log2, 1, sparse=True)


def _launch(q: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, rope: torch.Tensor,
            block_table: torch.Tensor,
            seq_lens: torch.Tensor, s_sl: int, indices: torch.Tensor, s_idx: tuple[int, ...], top_k: int,
            partial_out: torch.Tensor, partial_lse: torch.Tensor, num_seqs: int, softmax_scale_log2: float,
            q_len: int, *, sparse: bool) -> None:
    # The dense decode passes its block table as `indices` (never read) and the sparse one its table as
    # `seq_lens` (never read): one kernel, SPARSE choosing what a program's key slots are. A plain cache passes
    # its values as the scales (never read: FP8 is False).
    num_heads = q.shape[1]
    splits = partial_out.shape[2]
    # The queries come by cp.async too: rows it cannot copy are copied whole first (a small tensor).
    q = q if copyable(q) else q.contiguous()
    grid = (row_groups(num_heads, q_len), num_seqs, splits)
    _wgmma_split_kernel[grid](
        q, values, values if scales is None else scales, rope, block_table, seq_lens, indices, partial_out, partial_lse,
        num_heads, splits, top_k, block_table.shape[1] * values.shape[1], softmax_scale_log2, s_sl,
        *q.stride(), *values.stride(), *(values if scales is None else scales).stride(), *rope.stride(),
        *block_table.stride(), *s_idx,
        *partial_out.stride(), *partial_lse.stride(),
        KV_LORA_RANK=KV_LORA_RANK, ROPE_DIM=ROPE_DIM, PAGE_SIZE=values.shape[1],
        Q_LEN=q_len, SPARSE=sparse, STAGED_OUT=partial_out.dtype == q.dtype, FP8=scales is not None,
        num_warps=NUM_WARPS,
    )
