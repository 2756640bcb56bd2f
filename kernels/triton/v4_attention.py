"""DeepSeek-V4 attention over the paged window and compressed entries, with the sink: split flash decoding.

Every row (a decode token or a prompt token alike) attends over one virtual key
list: its window's n_w = min(sliding_window, key_len) keys, positions
[key_len - n_w, key_len) of the group-0 window cache, followed by its n_e
compressed entries (entries 0..n_e-1 for HCA, n_e = key_len // rate; the first
n_e = min(k, key_len // rate) slots of the indexer's ascending top-k list for CSA),
read from the entries cache through the compressed group's table. Keys are the
values (K = V), all heads share them, so a program holds BLOCK_H heads' queries
and streams [BLOCK_N, D] key tiles once for all of them.

Stage 1: grid (row, head group, split). Each row divides its *actual* list length
among the splits on the device (whole tiles per split), so a split's range may
straddle the window / entries boundary; each key of a tile picks its cache row
from one of the two caches. Splits of one row run the online softmax (base 2,
float32) over their range and write a normalised partial and its LSE.
Stage 2: one program per (row, head) merges the splits by LSE together with the
head's sink (a logit with a zero value). With one split, stage 1 folds the sink in
itself and writes the outputs.

On a Hopper GPU, where one split of 64-head programs makes one wave of work (`wgmma_parts`), stage 1
is the warpgroup-MMA twin of this file's kernel (`gluon.v4_attention`), the sink folded in: two
programs a row and head group (each the scores and half the output columns) where that fills the wave,
one (the scores computed once, both halves of the columns) where the rows alone do; this file's kernel
stays the path the CPU interpreter checks and the one every other shape and GPU runs.

Either cache may be an `FP8LatentCache` (`kv_cache_dtype="fp8"`; both caches of one type): a key
tile is then read from its three leaves (the C leading values in e4m3, their group scales, the R
rotated values) and dequantized in registers as `FP8LatentCache.rows` does (value times scale in
float32, rounded once to q's dtype) before the products. The warpgroup-MMA twin takes FP8 caches of
V4's shape (448 values and 64 RoPE values a key) too: it copies a tile's e4m3 values into shared memory
as they are and widens them there to the same dequantized rows.

Empty ranges carry lse -inf and shift by 0 (weights 0, never NaN); a padded row
(key_len 0) has no key at all and gets out 0 (the sink alone). The split count
depends on static shapes and the device only (`v4_attention_num_splits`), so a
captured graph stays valid for any lengths and indices, and nothing syncs.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..gluon import mla_decode as gluon_decode
from ..gluon import v4_attention as gluon_v4
from ..latent_cache import FP8_GROUP, FP8LatentCache, LatentCache
from ._common import LN2, LOG2E, check_float, dot_precision, next_pow2, online_softmax_fold, pdl, sm_count
from .decode import DecodeConfig, decode_config, fill_splits
from .decode_merge import split_partials

# Chosen on an H100 by `bench/v4_kernels.py --sweep` (bf16, D=512, 64 heads, B=64, 64K context,
# 640 keys a row; bench/results/v4-kernels/h100/logs-archive/v4-sweep-h100-2026-11-23.log). A row has few keys (the window
# plus at most top-k / context/128 entries), so a program's fixed cost — its [H, 512] queries and
# float32 partial — weighs as much as its keys: 64 heads a program with 64-key tiles read each key
# tile once for all heads (HCA 58 us vs 70-90 us for 32 heads a program), and one wave of programs
# beats more splits (2 splits 82 us, 4 splits 99 us, CSA). Below 64 heads the dense decode's tiles.
_GPU_CONFIG_64_HEADS = DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
# Up to _FEW_ROWS rows, 64+ heads take 16 heads a program and splits of one 32-key tile: a row's
# keys are then read once per 16 heads, but its work spreads over four times the programs, each
# with a quarter of the queries and of the float32 partial to move. H200, 64 heads, 64K context,
# a row of 640 keys, us at batch 1, 64 heads a program with 10 splits / 16 heads with 20:
# CSA 14.5 / 9.4, HCA 13.5 / 8.6; at batch 64 the 64-head tiles stay (CSA 45.2 against 58.0)
# (bench/results/v4-step/h200/logs-archive/v4-attention-few-rows-h200-2026-11-26.log).
_FEW_ROWS = 4
_GPU_CONFIG_FEW_ROWS = DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3)
_PROGRAMS_PER_SM = 1
# No split takes fewer than _MIN_KEYS_PER_SPLIT keys of a row's longest possible list
# (window + entries), below which partial-result traffic ([H, D] float32 per split) outweighs the
# gain; up to _FEW_ROWS rows, where latency bounds a split, no fewer than one tile.
_MIN_KEYS_PER_SPLIT = 64
_MAX_SPLITS = 32
# Key tiles whose cache rows a program locates in one round before reading them (see the
# sparse decode's `_LOCATE_TILES`): then the key loads are asynchronous copies, prefetched.
_LOCATE_TILES = 16


# H100, bf16, 64 heads, 64K context, B = 64 (a sweep of the kernel's options beside this file's op,
# bench/results/v4-kernels/h100/logs-archive/v4-stage1-tiles-h100-2026-11-28.log): the warpgroup-MMA stage 1 with
# one split and two programs a row (each the scores and half the output columns) against this file's
# kernel at its two splits: HCA 36.1 against 46.9 us, CSA 46.6 against 48.3; at B = 128 (two waves of
# such programs) it lost (HCA 67.3 against 59.4), as did one program a row at B = 64 (one wave half
# full: HCA 49.4). So it runs where its programs make one wave at least half full. Where the rows alone
# fill one (H200, B = 128 x 64K, bench/notes/v4.md), one program a row computing each tile's scores once
# took 38.2 us against this file's kernel's 57.0 at HCA (CSA 45.0 against 65.3); at B = 64 it lost, over
# two splits (33.8 against the two programs' 28.9 then, 27.4 since 5b7715f) as over one (34.0).
_WGMMA_PARTS = 2


def wgmma_parts(num_rows: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Programs a (row, head group) of the warpgroup-MMA stage 1 (`gluon.v4_attention`), or 0 where this
    file's kernel runs stage 1: static shapes and the device only, so a captured graph keeps its kernel.
    It runs on Hopper for 16-bit queries, D = 512, >= 64 heads, where its programs (one split) fill one
    wave at least half: two a row and head group where those do (at 64 heads on 132 multiprocessors:
    34..66 rows), else one where those do (67..132 rows)."""
    if not gluon_v4.applies(num_heads, head_dim, dtype, device):
        return 0
    programs = num_rows * triton.cdiv(num_heads, gluon_v4.BLOCK_M)
    slots = sm_count(device)
    for parts in (_WGMMA_PARTS, 1):
        if slots // 2 < programs * parts <= slots:
            return parts
    return 0


def v4_attention_config(num_heads: int, num_rows: int, device: torch.device) -> DecodeConfig:
    """The tiles for `num_rows` rows of `num_heads` heads (static shapes and the device only)."""
    if device.type == "cuda" and num_heads >= 64:
        return _GPU_CONFIG_FEW_ROWS if num_rows <= _FEW_ROWS else _GPU_CONFIG_64_HEADS
    return decode_config(num_heads, device)


def fp8_tiles(config: DecodeConfig, device: torch.device) -> DecodeConfig:
    """The tiles over FP8 caches on a GPU. A key tile is widened to float32 and scaled in registers: the
    64-head tiles stay (H200, B64 x 64K, a sweep of 36 tiles: HCA 55.1 us, CSA 62.4, against 65.5 and 64.8
    without pipelining; `bench/notes/v4.md`), the few-row tiles take no load pipelining (B1: 9.9 against
    10.9 us over two stages; 64-key tiles of 16 or 32 heads over two stages do not fit shared memory)."""
    if device.type != "cuda" or config.block_h >= 64:
        return config
    return dataclasses.replace(config, block_n=min(config.block_n, 32), num_stages=1)


def v4_attention_num_splits(num_rows: int, num_heads: int, max_keys: int, device: torch.device | str,
                            config: DecodeConfig | None = None) -> int:
    """Splits per row from static shapes and the device: max_keys = sliding_window + the entry list's
    capacity (top-k, or every entry the table can hold)."""
    device = torch.device(device)
    config = config or v4_attention_config(num_heads, num_rows, device)
    programs = max(1, num_rows) * triton.cdiv(num_heads, config.block_h)
    min_keys = min(_MIN_KEYS_PER_SPLIT, config.block_n) if num_rows <= _FEW_ROWS else _MIN_KEYS_PER_SPLIT
    return fill_splits(programs, max_keys, device, min_keys=min_keys, max_splits=_MAX_SPLITS,
                       interpreter_min_keys=config.block_n, programs_per_sm=_PROGRAMS_PER_SM)


def max_keys_of(sliding_window: int, entry_cache: LatentCache | None, entry_table: torch.Tensor | None,
                entry_indices: torch.Tensor | None) -> int:
    """The longest key list a row can have (static)."""
    if entry_cache is None or entry_table is None:
        return sliding_window
    if entry_indices is not None:
        return sliding_window + entry_indices.shape[1]
    return sliding_window + entry_table.shape[1] * entry_cache.shape[1]


def v4_attention_workspace(num_rows: int, num_heads: int, head_dim: int, max_keys: int,
                           device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials for `window_entry_attention(..., workspace=...)`, allocated once per static shape:
    (partial_out [n, H, S, D] float32, partial_lse [n, H, S] float32), S = v4_attention_num_splits(...)."""
    splits = v4_attention_num_splits(num_rows, num_heads, max_keys, device)
    return (torch.empty((num_rows, num_heads, splits, head_dim), dtype=torch.float32, device=device),
            torch.empty((num_rows, num_heads, splits), dtype=torch.float32, device=device))


@triton.jit
def _cache_codes(j, end, n_win, win_start, n_ent, entry_count, bt_row, et_row, idx_row, s_btw, s_etw, s_ik,
                 PAGE: tl.constexpr, ENTRY_PAGE: tl.constexpr, HAS_ENTRIES: tl.constexpr, HAS_INDICES: tl.constexpr):
    """Where the keys of virtual key slots j (< end) sit, as one int64 code each: a window cache
    slot (page * PAGE + offset) as itself, an entry cache slot s as -2 - s, no key as -1."""
    in_range = j < end
    is_win = in_range & (j < n_win)
    pos = win_start + j
    page = tl.load(bt_row + (pos // PAGE) * s_btw, mask=is_win, other=0).to(tl.int64)
    code = tl.where(is_win, page * PAGE + pos % PAGE, -1)
    if HAS_ENTRIES:
        slot = j - n_win
        is_ent = in_range & (slot >= 0) & (slot < n_ent)
        if HAS_INDICES:
            e = tl.load(idx_row + slot * s_ik, mask=is_ent, other=-1)
        else:
            e = slot
        is_ent = is_ent & (e >= 0) & (e < entry_count)
        e_page = tl.load(et_row + (e // ENTRY_PAGE) * s_etw, mask=is_ent, other=0).to(tl.int64)
        code = tl.where(is_ent, -2 - (e_page * ENTRY_PAGE + e % ENTRY_PAGE), code)
    return code


@triton.jit
def _key_rows(code, win_ptr, ent_ptr, s_wn, s_wb, s_en, s_eb,
              PAGE: tl.constexpr, ENTRY_PAGE: tl.constexpr, HAS_ENTRIES: tl.constexpr):
    """Row pointers of `_cache_codes` codes, and which of them are keys. Page and offset times
    their strides (not one flat offset), so the compiler keeps the strides' alignment and
    copies the rows asynchronously."""
    w_slot = tl.maximum(code, 0)
    row = win_ptr + (w_slot // PAGE) * s_wn + (w_slot % PAGE) * s_wb
    if HAS_ENTRIES:
        e_slot = tl.maximum(-2 - code, 0)
        row = tl.where(code >= 0, row, ent_ptr + (e_slot // ENTRY_PAGE) * s_en + (e_slot % ENTRY_PAGE) * s_eb)
    return row, code != -1


@triton.jit
def _leaf_rows(code, win_ptr, ent_ptr, s_wn, s_wb, s_en, s_eb,
               PAGE: tl.constexpr, ENTRY_PAGE: tl.constexpr, HAS_ENTRIES: tl.constexpr):
    """`_key_rows`' row pointers alone, for one leaf of the two caches (its own base pointers and strides)."""
    row, _ = _key_rows(code, win_ptr, ent_ptr, s_wn, s_wb, s_en, s_eb, PAGE, ENTRY_PAGE, HAS_ENTRIES)
    return row


@triton.jit
def _fp8_key_tile(code, key_mask, offs_d, win_ptr, ent_ptr, s_wn, s_wb, s_en, s_eb,
                  ws_ptr, es_ptr, s_wsn, s_wsb, s_esn, s_esb, wr_ptr, er_ptr, s_wrn, s_wrb, s_ern, s_erb,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_C: tl.constexpr, GROUP: tl.constexpr,
                  DTYPE: tl.constexpr, PAGE: tl.constexpr, ENTRY_PAGE: tl.constexpr, HAS_ENTRIES: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] key tile of `_cache_codes` codes from FP8 caches, in DTYPE: columns below
    KV_C are the e4m3 values times their group's float32 scale (rounded once), the rest the rope values.
    Each leaf's feature stride is 1 (checked by the wrapper). A key's scales are read once, [BLOCK_N, NG]
    for NG column blocks of SUB values (one group, or the whole tile when it is narrower than a group),
    and broadcast over each block's columns."""
    SUB: tl.constexpr = GROUP if GROUP < BLOCK_D else BLOCK_D
    NG: tl.constexpr = BLOCK_D // SUB
    values = _leaf_rows(code, win_ptr, ent_ptr, s_wn, s_wb, s_en, s_eb, PAGE, ENTRY_PAGE, HAS_ENTRIES)
    scales = _leaf_rows(code, ws_ptr, es_ptr, s_wsn, s_wsb, s_esn, s_esb, PAGE, ENTRY_PAGE, HAS_ENTRIES)
    rope = _leaf_rows(code, wr_ptr, er_ptr, s_wrn, s_wrb, s_ern, s_erb, PAGE, ENTRY_PAGE, HAS_ENTRIES)
    is_value = offs_d < KV_C
    is_rope = (offs_d >= KV_C) & (offs_d < HEAD_DIM)
    v = tl.load(values[:, None] + offs_d[None, :], mask=key_mask[:, None] & is_value[None, :], other=0.0)
    blocks = tl.arange(0, NG)
    scale = tl.load(scales[:, None] + (blocks * SUB // GROUP)[None, :],
                    mask=key_mask[:, None] & (blocks * SUB < KV_C)[None, :], other=0.0)
    block_n: tl.constexpr = v.shape[0]
    latent = tl.reshape(tl.reshape(v.to(tl.float32), (block_n, NG, SUB)) * scale[:, :, None], (block_n, BLOCK_D))
    r = tl.load(rope[:, None] + (offs_d - KV_C)[None, :], mask=key_mask[:, None] & is_rope[None, :], other=0.0)
    return tl.where(is_value[None, :], latent.to(DTYPE), r.to(DTYPE))


# Lengths and the split count follow the batch, which eager steps vary: as
# specialised ints they would compile a kernel per value mid-run.
@triton.jit(do_not_specialize=["num_splits", "window", "rate", "entry_k", "entry_capacity", "s_plh"])
def _v4_split_kernel(
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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, ENTRY_PAGE: tl.constexpr, HAS_ENTRIES: tl.constexpr, HAS_INDICES: tl.constexpr,
    FOLD_SINK: tl.constexpr, DOT_PRECISION: tl.constexpr, GDC: tl.constexpr, LOCATE_TILES: tl.constexpr,
    FP8: tl.constexpr, KV_C: tl.constexpr, GROUP: tl.constexpr,
):
    t = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    t64 = t.to(tl.int64)
    heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()

    key_len = tl.maximum(tl.load(klen_ptr + t64), 0)
    n_win = tl.minimum(key_len, window)
    entry_count = key_len * 0
    n_ent = key_len * 0
    if HAS_ENTRIES:
        # Entries past the table are no key (a pick there is masked, as the reference masks it).
        entry_count = tl.minimum(key_len // rate, entry_capacity)
        if HAS_INDICES:
            n_ent = tl.minimum(entry_count, entry_k)
        else:
            n_ent = entry_count
    total = n_win + n_ent
    # Whole tiles per split, so only a split's last tile is ragged.
    per_split = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, total)
    win_start = key_len - n_win

    q = tl.load(q_ptr + t64 * s_qt + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + t64 * s_btt
    et_row = et_ptr + t64 * s_ett
    idx_row = idx_ptr + t64 * s_it
    # The keys of 16 tiles are located in one round (table, index, table: a dependent
    # chain) before they are read, so the key loads of the inner loop depend only on
    # registers and the loop counter and are prefetched stages ahead.
    tile_ids = tl.arange(0, LOCATE_TILES)
    for c0 in range(start, end, LOCATE_TILES * BLOCK_N):
        codes = _cache_codes(c0 + tile_ids[:, None] * BLOCK_N + offs_n[None, :], end, n_win, win_start, n_ent,
                             entry_count, bt_row, et_row, idx_row, s_btw, s_etw, s_ik,
                             PAGE, ENTRY_PAGE, HAS_ENTRIES, HAS_INDICES)
        for jj in range(0, tl.minimum(LOCATE_TILES, tl.cdiv(end - c0, BLOCK_N))):
            code = tl.sum(tl.where(tile_ids[:, None] == jj, codes, 0), axis=0)
            if FP8:
                key_mask = code != -1
                keys = _fp8_key_tile(code, key_mask, offs_d, win_ptr, ent_ptr, s_wn, s_wb, s_en, s_eb,
                                     ws_ptr, es_ptr, s_wsn, s_wsb, s_esn, s_esb, wr_ptr, er_ptr, s_wrn, s_wrb,
                                     s_ern, s_erb, HEAD_DIM, BLOCK_D, KV_C, GROUP, q_ptr.dtype.element_ty,
                                     PAGE, ENTRY_PAGE, HAS_ENTRIES)
            else:
                row, key_mask = _key_rows(code, win_ptr, ent_ptr, s_wn, s_wb, s_en, s_eb, PAGE, ENTRY_PAGE,
                                          HAS_ENTRIES)
                if BLOCK_D == HEAD_DIM:
                    k_mask = key_mask[:, None]
                else:
                    k_mask = key_mask[:, None] & d_mask[None, :]
                # The window cache and the entries cache share the feature stride (both contiguous rows).
                keys = tl.load(row[:, None] + offs_d[None, :] * s_wd, mask=k_mask, other=0.0)
            scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)
            scores = tl.where(key_mask[None, :], scores * scale_log2, float("-inf"))
            m_i, l_i, acc = online_softmax_fold(scores, keys, m_i, l_i, acc, DOT_PRECISION)

    if FOLD_SINK:
        # The only split: the sink joins here as one more logit with a zero value.
        sink = tl.load(sink_ptr + heads * s_sink, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        shift = tl.where(m_f == float("-inf"), 0.0, m_f)
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.exp2(sink - shift)
        acc = acc * alpha[:, None]
        m_i = shift
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))
    po_row = po_ptr + t64 * s_pot + heads[:, None] * s_poh + split * s_pos
    tl.store(po_row + offs_d[None, :] * s_pod, out.to(po_ptr.dtype.element_ty),
             mask=head_mask[:, None] & d_mask[None, :])
    tl.store(pl_ptr + t64 * s_plt + heads * s_plh + split * s_pls, lse, mask=head_mask)


@triton.jit(do_not_specialize=["num_splits", "s_plh"])
def _v4_merge_kernel(
    po_ptr, pl_ptr, sink_ptr, out_ptr, lse_ptr,
    num_heads, num_splits, s_sink,
    s_pot, s_poh, s_pos, s_pod,
    s_plt, s_plh, s_pls,
    s_ot, s_oh, s_od, s_lt, s_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, GDC: tl.constexpr,
):
    pid = tl.program_id(0)
    t = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    # The sink is a weight: its load overlaps stage 1's tail.
    sink = tl.load(sink_ptr + h * s_sink).to(tl.float32)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    lse_s = tl.load(pl_ptr + t * s_plt + h * s_plh + offs_s * s_pls, mask=s_mask, other=float("-inf"))
    m = tl.maximum(tl.max(lse_s, axis=0), sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m)
    total = tl.sum(w, axis=0) + tl.exp(sink - m)
    w = w * tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        d = d0 + offs_d
        d_mask = d < HEAD_DIM
        parts = tl.load(po_ptr + t * s_pot + h * s_poh + offs_s[:, None] * s_pos + d[None, :] * s_pod,
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        tl.store(out_ptr + t * s_ot + h * s_oh + d * s_od, tl.sum(parts * w[:, None], axis=0).to(
            out_ptr.dtype.element_ty), mask=d_mask)
    lse = tl.where(total > 0.0, m + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * s_lt + h * s_lh, lse)


def _check_fp8_keys(name: str, cache: LatentCache, q: torch.Tensor) -> FP8LatentCache:
    """An FP8 key cache the kernel can read: each leaf's rows contiguous, RoPE values in q's dtype."""
    if not isinstance(cache, FP8LatentCache):
        raise ValueError(f"{name}: expected an FP8LatentCache beside an FP8 window cache (both caches of one "
                         f"type), got a {type(cache).__name__}")
    check_dtype(f"{name}.rope", cache.rope, (q.dtype,))
    for leaf, t in (("values", cache.values), ("scales", cache.scales), ("rope", cache.rope)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}.{leaf}: expected contiguous rows (feature stride 1), got stride {t.stride(2)}")
    return cache


def _fp8_leaves(window_cache: LatentCache, entry_cache: LatentCache | None, window_values: torch.Tensor,
                head_dim: int) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], int]:
    """The kernel's FP8 arguments: (window scales, entry scales, window rope, entry rope), their (page, row)
    strides, and C; for tensor caches the window's tensor stands in (never read) and C = head_dim."""
    if isinstance(window_cache, FP8LatentCache) and isinstance(entry_cache, FP8LatentCache):
        leaves = (window_cache.scales, entry_cache.scales, window_cache.rope, entry_cache.rope)
        strides = tuple(s for t in leaves for s in t.stride()[:2])
        return leaves, strides, window_cache.kv_lora_rank
    return (window_values,) * 4, (0,) * 8, head_dim


def window_entry_attention(
    q: torch.Tensor,
    window_cache: LatentCache,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int,
    entry_cache: LatentCache | None = None,
    entry_table: torch.Tensor | None = None,
    entry_indices: torch.Tensor | None = None,
    compress_rate: int = 0,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 attention of each row over its window and compressed entries, with the per-head sink.

    q:             [n, H, D] (any strides), bf16 / fp16 / fp32
    window_cache:  [nb, bs, D] same dtype, rows contiguous, or an `FP8LatentCache` (D = C + R, RoPE values
                   in q's dtype); block_table [n, W] int32; key_lens [n] int32
    sinks:         [H] float (one logit per head)
    entry_cache:   [nbg, bsg, D] of the window cache's type, rows contiguous, or None (no entries scope);
                   entry_table [n, Wg] int32; entry_indices [n, k] int32 (ascending, -1 tail) or None (HCA)
    workspace:     (partial_out [n, H, S, D] fp32, partial_lse [n, H, S] fp32) from
                   `v4_attention_workspace`, so a captured graph allocates only its outputs; None
                   allocates it here. Unused when S == 1.
    num_splits:    overrides `v4_attention_num_splits` (tests); config: overrides the tiles (sweeps); either
                   keeps this file's stage 1 (`wgmma_parts` picks the other only without them)
    returns        out [n, H, D] in q's dtype, lse [n, H] float32 (scopes and sink); see
                   `reference.v4_paged.window_entry_attention` for the contract.
    """
    num_rows, num_heads, head_dim = q.shape
    check_float("q", q)
    check_shape("window_cache", window_cache, (None, None, head_dim))
    check_shape("block_table", block_table, (num_rows, None))
    check_shape("key_lens", key_lens, (num_rows,))
    check_shape("sinks", sinks, (num_heads,))
    check_dtype("block_table", block_table, (torch.int32,))
    check_dtype("key_lens", key_lens, (torch.int32,))
    check_float("sinks", sinks)
    # The tensor the kernel reads rows of (an FP8 cache's values; its scales and RoPE values come beside them).
    if isinstance(window_cache, FP8LatentCache):
        window_values = _check_fp8_keys("window_cache", window_cache, q).values
    else:
        check_dtype("window_cache", window_cache, (q.dtype,))
        window_values = window_cache
    check_same_device(q=q, window_cache=window_values, block_table=block_table, key_lens=key_lens, sinks=sinks)
    if sliding_window < 1:
        raise ValueError(f"sliding_window: expected >= 1, got {sliding_window}")
    entry_values = window_values  # read only with entries
    if entry_cache is not None:
        if entry_table is None or compress_rate < 1:
            raise ValueError(f"window_entry_attention: entries need entry_table and compress_rate >= 1, got "
                             f"entry_table={'None' if entry_table is None else tuple(entry_table.shape)}, "
                             f"compress_rate={compress_rate}")
        check_shape("entry_cache", entry_cache, (None, None, head_dim))
        check_shape("entry_table", entry_table, (num_rows, None))
        check_dtype("entry_table", entry_table, (torch.int32,))
        if isinstance(window_cache, FP8LatentCache):
            entry_values = _check_fp8_keys("entry_cache", entry_cache, q).values
        elif isinstance(entry_cache, torch.Tensor):
            check_dtype("entry_cache", entry_cache, (q.dtype,))
            if entry_cache.stride(2) != window_values.stride(2):
                raise ValueError(f"entry_cache: expected feature stride {window_values.stride(2)} (the window "
                                 f"cache's), got {entry_cache.stride(2)}")
            entry_values = entry_cache
        else:
            raise ValueError(f"entry_cache: expected a tensor beside a tensor window cache (both caches of one "
                             f"type), got a {type(entry_cache).__name__}")
        check_same_device(q=q, entry_cache=entry_values, entry_table=entry_table)
        if entry_indices is not None:
            check_shape("entry_indices", entry_indices, (num_rows, None))
            check_dtype("entry_indices", entry_indices, (torch.int32,))
            check_same_device(q=q, entry_indices=entry_indices)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
    device = q.device
    fp8 = isinstance(window_cache, FP8LatentCache)
    parts = 0 if num_splits is not None or config is not None else \
        wgmma_parts(num_rows, num_heads, head_dim, q.dtype, device)
    config = config or v4_attention_config(num_heads, num_rows, device)
    if fp8:
        config = fp8_tiles(config, device)
    max_keys = max_keys_of(sliding_window, entry_cache, entry_table, entry_indices)
    splits = num_splits or v4_attention_num_splits(num_rows, num_heads, max_keys, device, config)

    out = torch.empty((num_rows, num_heads, head_dim), dtype=q.dtype, device=device)
    lse = torch.empty((num_rows, num_heads), dtype=torch.float32, device=device)
    if num_rows == 0:
        return out, lse
    has_entries = entry_cache is not None
    # Without entries the entry arguments are never read: the window's tensors stand in for them.
    e_table = entry_table if entry_table is not None and has_entries else block_table
    indices = entry_indices if entry_indices is not None and has_entries else block_table
    use_pdl = pdl(device)
    # The warpgroup-MMA kernel's FP8 leaves (scales and RoPE values of both caches), or None for 16-bit caches.
    wgmma_fp8 = None
    if isinstance(window_cache, FP8LatentCache):
        entry_fp8 = entry_cache if isinstance(entry_cache, FP8LatentCache) else window_cache
        wgmma_fp8 = (window_cache.scales, entry_fp8.scales, window_cache.rope, entry_fp8.rope)
        if window_cache.kv_lora_rank != gluon_v4.FP8_KV_C or not gluon_decode.copyable(*wgmma_fp8[2:]):
            parts = 0
    if parts and gluon_decode.copyable(window_values, entry_values):
        gluon_v4.window_entry_split(
            q, window_values, block_table, key_lens, entry_values, e_table, indices, sinks,
            out.view(num_rows, num_heads, 1, head_dim), lse.view(num_rows, num_heads, 1),
            softmax_scale_log2=softmax_scale * LOG2E, sliding_window=sliding_window, compress_rate=compress_rate,
            has_entries=has_entries, has_indices=entry_indices is not None, fold_sink=True, d_split=parts,
            use_pdl=use_pdl, fp8_leaves=wgmma_fp8)
        return out, lse
    partial_out, partial_lse = split_partials(out, lse, splits, direct=splits == 1, workspace=workspace)
    entry_k = indices.shape[1]
    entry_capacity = e_table.shape[1] * entry_values.shape[1]
    leaves, leaf_strides, kv_c = _fp8_leaves(window_cache, entry_cache if has_entries else window_cache,
                                             window_values, head_dim)
    grid = (num_rows, triton.cdiv(num_heads, config.block_h), splits)
    _v4_split_kernel[grid](
        q, window_values, block_table, key_lens, entry_values, e_table, indices, sinks, partial_out, partial_lse,
        *leaves,
        num_heads, splits, sliding_window, max(1, compress_rate), entry_k, entry_capacity,
        softmax_scale * LOG2E, sinks.stride(0),
        *q.stride(), *window_values.stride(), *block_table.stride(), *entry_values.stride(), *e_table.stride(),
        *indices.stride(), *partial_out.stride(), *partial_lse.stride(), *leaf_strides,
        HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        PAGE=window_values.shape[1], ENTRY_PAGE=entry_values.shape[1], HAS_ENTRIES=has_entries,
        HAS_INDICES=has_entries and entry_indices is not None, FOLD_SINK=splits == 1,
        DOT_PRECISION=dot_precision(q.dtype), GDC=use_pdl, LOCATE_TILES=_LOCATE_TILES,
        FP8=fp8, KV_C=kv_c, GROUP=FP8_GROUP,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    if splits > 1:
        merge_with_sink(partial_out, partial_lse, sinks, out, lse, use_pdl)
    return out, lse


def merge_with_sink(partial_out: torch.Tensor, partial_lse: torch.Tensor, sinks: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, use_pdl: bool) -> None:
    """Stage 2: partial_out [n, H, S, D] (any float dtype), partial_lse [n, H, S] float32, sinks [H] -> out
    [n, H, D], lse [n, H] (written): the splits merged by LSE with each head's sink."""
    num_rows, num_heads, splits, head_dim = partial_out.shape
    _v4_merge_kernel[(num_rows * num_heads,)](
        partial_out, partial_lse, sinks, out, lse,
        num_heads, splits, sinks.stride(0),
        *partial_out.stride(), *partial_lse.stride(), *out.stride(), *lse.stride(),
        HEAD_DIM=head_dim, BLOCK_D=min(512, next_pow2(head_dim)), BLOCK_S=next_pow2(splits), GDC=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )


def v4_attention_bytes(num_rows: int, num_heads: int, head_dim: int, keys_per_row: int, itemsize: int) -> int:
    """Bytes a V4 attention must move: every row's keys (window + entries), its queries and outputs."""
    return itemsize * num_rows * (keys_per_row * head_dim + 2 * num_heads * head_dim)
