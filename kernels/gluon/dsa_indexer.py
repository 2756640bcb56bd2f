"""The lightning indexer's scores on Hopper's warpgroup MMA: key tiles by TMA, every multiprocessor busy to the end.

scores[t, j] = sum_h w[t, h] * relu(q[t, h] . key_j), w = head_weights * weight_scale, as the `tl.dot` twin
(`triton.dsa_indexer`) computes them: each 64-key tile is one product [64 keys, Di] x [Di, Hi] on the
warpgroup MMA (keys as its rows, the row's 64 heads as its N, both from shared memory, float32
accumulation), then the sum over heads along the accumulator's columns.

A tile comes by TMA (the cache viewed as [num_blocks * bs, Di]): one copy where a page holds whole tiles
(bs a multiple of 64), 64 / bs copies where a tile spans pages. Copies run STAGES - 1 tiles ahead of the
product, and the block-table reads a copy waits on run one tile before that. Over an `FP8IndexCache` a tile
comes as its e4m3 bytes (half the copy), goes to the product from registers widened to q's dtype (exact),
and each key's logits are multiplied by its scale (read a tile ahead) before the relu, as the twin does.

The twin gives every row the same chunks, a program each, and the last of its programs run with most
multiprocessors idle. Here PROGRAMS_PER_SM programs a multiprocessor split the launch's tiles, rows one
after the other, into equal runs: a run may start inside one row and end inside another (the queries are
read again where it enters a row). Several small programs a multiprocessor keep its copies flowing while
one of them multiplies or stores: at two stages and four programs B64 x 32K read 92% of the copy rate on
an H200, against 90% at four stages and two programs, 77-78% (76.7 at 12) at one program of 6-12 stages,
and the twin's 85% (bench/notes/dsa.md). A tile at or past its row's key count reads no key: it writes -inf
over its positions in its turn, and its stage's phase completes without a copy.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..index_cache import FP8IndexCache, IndexCache
from .dependent_launch import gdc_launch_dependents, gdc_wait
from .support import available

# Keys a tile (the MMA's M), and the indexer shape the tiles are laid out for (V3.2's and V4's).
BLOCK_N = 64
NUM_HEADS = 64
HEAD_DIM = 128
NUM_WARPS = 4
STAGES = 2
PROGRAMS_PER_SM = 4


def applies(q: torch.Tensor, index_cache: IndexCache) -> bool:
    """Whether the kernel takes these scores: 16-bit queries [T, 64, 128] over a cache [nb, bs, 128] of their dtype
    or an `FP8IndexCache`, whose keys TMA can read as tiles (contiguous, 16-byte aligned; bs a multiple of 64, or
    8, 16 or 32 pages a tile spans), on a Hopper GPU under the Triton release the kernel is written for."""
    fp8 = isinstance(index_cache, FP8IndexCache)
    keys = index_cache.values if isinstance(index_cache, FP8IndexCache) else index_cache
    page_size = keys.shape[1]
    return (q.dtype in (torch.bfloat16, torch.float16) and (fp8 or keys.dtype == q.dtype)
            and tuple(q.shape[1:]) == (NUM_HEADS, HEAD_DIM) and keys.shape[2] == HEAD_DIM
            and (page_size % BLOCK_N == 0 or page_size in (8, 16, 32))
            and keys.is_contiguous() and keys.data_ptr() % 16 == 0 and available(q.device))


@gluon.jit
def _tile_of(i, first, tiles_per_row):
    # (row, first position) of a program's i-th tile.
    g = first + i
    return g // tiles_per_row, (g % tiles_per_row) * 64


@gluon.jit
def _locate(row, pos0, num_rows, num_cols, key_lens_ptr, bt_ptr, s_kl, s_btt, s_btw, PAGE_SIZE: gl.constexpr,
            SUB: gl.constexpr, sub_layout: gl.constexpr):
    # (whether the tile at (row, pos0) holds a key, the pages of its SUB runs [SUB]): what its copy waits on.
    real = row < num_rows
    safe_row = gl.where(real, row, 0)
    key_len = gl.minimum(gl.maximum(gl.load(key_lens_ptr + safe_row * s_kl), 0), num_cols)
    visible = real & (pos0 < key_len)
    entry = pos0 // PAGE_SIZE + gl.arange(0, SUB, layout=sub_layout)
    # A run past the table's end (a tile over its last, partial page run) reads page 0, masked out later.
    pages = gl.load(bt_ptr + safe_row.to(gl.int64) * s_btt + entry * s_btw,
                    mask=visible & (entry * PAGE_SIZE < num_cols), other=0)
    return visible, pages


@gluon.jit
def _tile_scales(row, pos0, num_rows, num_cols, key_lens_ptr, bt_ptr, sc_ptr, s_kl, s_btt, s_btw, s_scn, s_scb,
                 PAGE_SIZE: gl.constexpr, layout: gl.constexpr):
    # The FP8 keys' scales [64] of the tile at (row, pos0), in `layout`; 0 past the row's keys.
    real = row < num_rows
    safe_row = gl.where(real, row, 0)
    key_len = gl.minimum(gl.maximum(gl.load(key_lens_ptr + safe_row * s_kl), 0), num_cols)
    pos = pos0 + gl.arange(0, 64, layout=layout)
    visible = real & (pos < key_len)
    page = gl.load(bt_ptr + safe_row.to(gl.int64) * s_btt + (pos // PAGE_SIZE) * s_btw, mask=visible, other=0)
    return gl.load(sc_ptr + page.to(gl.int64) * s_scn + (pos % PAGE_SIZE) * s_scb, mask=visible, other=0.0)


@gluon.jit
def _issue(k_desc, k_smem, ready, stage, taken, visible, pages, pos0, PAGE_SIZE: gl.constexpr, SUB: gl.constexpr,
           sub_layout: gl.constexpr):
    # Starts a taken tile's copy into `stage` where it holds keys; one with none completes the stage's phase
    # at once. A program's tiles past its run take nothing.
    bar = ready.index(stage)
    load = taken & visible
    mbarrier.expect(bar, SUB * k_desc.block_type.nbytes, pred=load)
    RUN: gl.constexpr = 64 // SUB
    runs = gl.arange(0, SUB, layout=sub_layout)
    for r in gl.static_range(SUB):
        page = gl.sum(gl.where(runs == r, pages, 0), axis=0)
        tma.async_copy_global_to_shared(k_desc, [page * PAGE_SIZE + pos0 % PAGE_SIZE, 0], bar,
                                        k_smem.index(stage).slice(r * RUN, RUN, dim=0), pred=load)
    mbarrier.arrive(bar, count=1, pred=taken & (visible == 0))


# Row and tile counts follow the batch; the run length the device: as specialised ints they would compile a
# kernel per value.
@gluon.jit(do_not_specialize=["num_rows", "num_cols", "tiles_per_row", "tiles_per_program"])
def _scores_kernel(
    q_ptr, w_ptr, k_desc, sc_ptr, bt_ptr, key_lens_ptr, out_ptr,
    weight_scale, num_rows, num_cols, tiles_per_row, tiles_per_program,
    s_qt, s_qh, s_qd, s_wt, s_wh, s_scn, s_scb, s_btt, s_btw, s_kl, s_ot, s_oj,
    PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, GDC: gl.constexpr, FP8: gl.constexpr,
):
    BLOCK_N: gl.constexpr = 64
    NUM_HEADS: gl.constexpr = 64
    HEAD_DIM: gl.constexpr = 128
    # Runs of one page a tile: 64 / PAGE_SIZE where pages are shorter than a tile.
    SUB: gl.constexpr = 64 // PAGE_SIZE if PAGE_SIZE < 64 else 1
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    first = gl.program_id(0) * tiles_per_program
    num_tiles = gl.maximum(gl.minimum(tiles_per_program, num_rows * tiles_per_row - first), 0)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, NUM_HEADS, 16])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    # A tile's page runs, every one in every thread (the copies' scalars are sums in registers).
    sub_layout: gl.constexpr = gl.BlockedLayout([SUB], [32], [4], [0])
    # FP8: the keys come as e4m3 bytes and go to the product from registers, widened to q's dtype (exact).
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_HEADS, HEAD_DIM],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)

    # The first STAGES - 1 tiles' copies, then the reads the next one's copy waits on.
    for s in gl.static_range(STAGES - 1):
        row, pos0 = _tile_of(s, first, tiles_per_row)
        visible, pages = _locate(row, pos0, num_rows, num_cols, key_lens_ptr, bt_ptr, s_kl, s_btt, s_btw, PAGE_SIZE,
                                 SUB, sub_layout)
        _issue(k_desc, k_smem, ready, s, s < num_tiles, visible, pages, pos0, PAGE_SIZE, SUB, sub_layout)
    row, next_pos0 = _tile_of(STAGES - 1, first, tiles_per_row)
    next_visible, next_pages = _locate(row, next_pos0, num_rows, num_cols, key_lens_ptr, bt_ptr, s_kl, s_btt, s_btw,
                                       PAGE_SIZE, SUB, sub_layout)

    # FP8: a tile's scales are read a tile ahead (block table, then scales), carried in registers.
    row, pos0 = _tile_of(0, first, tiles_per_row)
    next_scales = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, acc_layout))
    if FP8:
        next_scales = _tile_scales(row, pos0, num_rows, num_cols, key_lens_ptr, bt_ptr, sc_ptr, s_kl, s_btt, s_btw,
                                   s_scn, s_scb, PAGE_SIZE, gl.SliceLayout(1, acc_layout))

    heads = gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(0, acc_layout))
    q_heads = gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(1, q_layout))
    q_dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    zero = gl.zeros([BLOCK_N, NUM_HEADS], gl.float32, layout=acc_layout)
    weights = gl.zeros([NUM_HEADS], gl.float32, layout=gl.SliceLayout(0, acc_layout))
    q_row = -1
    for i in range(num_tiles):
        # Every warp is past tile i - 1's product: its stage takes tile i + STAGES - 1.
        gl.thread_barrier()
        _issue(k_desc, k_smem, ready, (i + STAGES - 1) % STAGES, i + STAGES - 1 < num_tiles, next_visible,
               next_pages, next_pos0, PAGE_SIZE, SUB, sub_layout)
        row, next_pos0 = _tile_of(i + STAGES, first, tiles_per_row)
        next_visible, next_pages = _locate(row, next_pos0, num_rows, num_cols, key_lens_ptr, bt_ptr, s_kl, s_btt,
                                           s_btw, PAGE_SIZE, SUB, sub_layout)

        scales = next_scales
        if FP8:
            row, pos0 = _tile_of(i + 1, first, tiles_per_row)
            next_scales = _tile_scales(row, pos0, num_rows, num_cols, key_lens_ptr, bt_ptr, sc_ptr, s_kl, s_btt,
                                       s_btw, s_scn, s_scb, PAGE_SIZE, gl.SliceLayout(1, acc_layout))

        row, pos0 = _tile_of(i, first, tiles_per_row)
        key_len = gl.minimum(gl.maximum(gl.load(key_lens_ptr + row * s_kl), 0), num_cols)
        pos = pos0 + offs
        out_ptrs = out_ptr + row.to(gl.int64) * s_ot + pos * s_oj
        mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
        if pos0 < key_len:
            if row != q_row:
                # The run enters a row: its queries into shared memory (no product over the last row's runs).
                q = gl.load(q_ptr + row.to(gl.int64) * s_qt + gl.expand_dims(q_heads * s_qh, 1)
                            + gl.expand_dims(q_dims * s_qd, 0))
                # Heads' weights times the scale in float32, one rounding, as the twin's.
                weights = gl.load(w_ptr + row.to(gl.int64) * s_wt + heads * s_wh) * weight_scale
                q_smem.store(q)
                fence_async_shared()
                gl.thread_barrier()
                q_row = row
            if FP8:
                keys = k_smem.index(i % STAGES).load(a_layout).to(dtype)
                logits = warpgroup_mma(keys, q_smem.permute((1, 0)), zero, use_acc=False)
                # A key's scale times its logits, before the relu (the twin's order, so its bits).
                logits = logits * gl.expand_dims(scales, 1)
            else:
                logits = warpgroup_mma(k_smem.index(i % STAGES), q_smem.permute((1, 0)), zero, use_acc=False)
            score = gl.sum(gl.maximum(logits, 0.0) * gl.expand_dims(weights, 0), axis=1)
            # Stored from the product's layout (each score by the four lanes that summed it): a layout
            # change through shared memory first was no faster.
            gl.store(out_ptrs, gl.where(pos < key_len, score, float("-inf")), mask=pos < num_cols)
        else:
            gl.store(out_ptrs, gl.full([BLOCK_N], float("-inf"), gl.float32, layout=gl.SliceLayout(1, acc_layout)),
                     mask=pos < num_cols)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


def index_scores_wgmma(q: torch.Tensor, head_weights: torch.Tensor, index_cache: IndexCache,
                       block_table: torch.Tensor, key_lens: torch.Tensor, out: torch.Tensor, *, weight_scale: float,
                       sm_count: int, use_pdl: bool, stages: int = STAGES,
                       programs_per_sm: int = PROGRAMS_PER_SM) -> torch.Tensor:
    """`triton.dsa_indexer.index_scores` on the warpgroup MMA; shapes are the caller's to check (`applies`).

    q [T, 64, 128] (any strides), head_weights [T, 64] float32, index_cache [nb, bs, 128] (q's dtype) or an
    `FP8IndexCache` (values [nb, bs, 128] e4m3, scales [nb, bs, 1] float32), block_table [T, W] int32, key_lens [T]
    int32, out [T, W * bs] float32: written and returned. stages, programs_per_sm: overrides (benchmark sweeps;
    two stages and four programs a multiprocessor by default).
    """
    num_rows = q.shape[0]
    fp8 = isinstance(index_cache, FP8IndexCache)
    if isinstance(index_cache, FP8IndexCache):
        keys, scales = index_cache.values, index_cache.scales
    else:
        # A plain cache passes itself as the scales (never read: FP8 is False).
        keys = scales = index_cache
    num_blocks, page_size, head_dim = keys.shape
    num_cols = out.shape[1]
    tiles_per_row = -(-num_cols // BLOCK_N)
    total = num_rows * tiles_per_row
    if total == 0:
        return out
    programs = max(1, min(total, sm_count * programs_per_sm))
    tiles_per_program = -(-total // programs)
    programs = -(-total // tiles_per_program)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8 * keys.element_size(), rank=2)
    k_desc = TensorDescriptor.from_tensor(keys.view(num_blocks * page_size, head_dim),
                                          [min(page_size, BLOCK_N), head_dim], layout)
    _scores_kernel[(programs,)](
        q, head_weights, k_desc, scales, block_table, key_lens, out,
        float(weight_scale), num_rows, num_cols, tiles_per_row, tiles_per_program,
        *q.stride(), *head_weights.stride(), scales.stride(0), scales.stride(1), *block_table.stride(),
        key_lens.stride(0), *out.stride(),
        PAGE_SIZE=page_size, STAGES=stages, GDC=use_pdl, FP8=fp8, num_warps=NUM_WARPS, launch_pdl=use_pdl,
    )
    return out
