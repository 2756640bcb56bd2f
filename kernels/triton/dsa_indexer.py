"""The lightning indexer of DeepSeek sparse attention: its key cache write and its scores.

`write_index_key` writes a key as it is, or, into an `FP8IndexCache`, quantized (one scale a key, the
reference's rounding bit for bit). `index_scores` scores every visible position of a row's paged
indexer cache (FP8 keys read as one byte a value, each key's logits times its scale):
scores[t, j] = sum_h w[t, h] * relu(q[t, h] . key_j), w = head_weights * weight_scale.
A program owns one row and one contiguous chunk of its positions; it keeps the
row's queries [Hi, Di] and head weights on chip and streams key tiles [BLOCK_N, Di]
through one matmul each ([BLOCK_N, Di] x [Di, Hi] on tensor cores, float32
accumulation), so every key byte is read once per row and the work is bound by
the key reads. Positions at or past the row's key count get -inf, written by the
chunk's programs without reading any key.

The chunk count per row depends only on static shapes and the device
(`index_scores_num_chunks`): enough programs for several waves over the
multiprocessors, so rows of unequal lengths still balance, and no chunk shorter
than a few tiles.

On Hopper, with 16-bit queries of 64 heads of 128, the scores come from the warpgroup-MMA kernel
(`gluon.dsa_indexer`, `IndexerConfig.wgmma`), of which this kernel is the `tl.dot`
twin: the same product a 64-key tile and the same sum over heads, so the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..gluon import dsa_indexer as gluon_indexer
from ..index_cache import FP8IndexCache, IndexCache
from ._common import check_float, dot_precision, next_pow2, pdl, sm_count
from .cache import write_kv
from .fp8_quant import quantize_tile


@triton.jit(do_not_specialize=["num_rows"])
def _write_fp8_key_kernel(
    key_ptr, slot_ptr, values_ptr, scales_ptr,
    num_rows, head_dim, block_size,
    s_kt, s_kd, s_slot, s_vn, s_vb, s_vd, s_sn, s_sb,
    BLOCK_D: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row * s_slot).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        key = tl.load(key_ptr + row.to(tl.int64) * s_kt + d * s_kd, mask=d_mask, other=0.0).to(tl.float32)
        # One group a key: the columns past Di are zeros, which change no largest magnitude.
        values, scale = quantize_tile(key[None, :], False)
        page, offset = slot // block_size, slot % block_size
        tl.store(values_ptr + page * s_vn + offset * s_vb + d[None, :] * s_vd, values, mask=d_mask[None, :])
        tl.store(scales_ptr + page * s_sn + offset * s_sb, tl.sum(scale, axis=0))


@overload
def write_index_key(index_cache: torch.Tensor, slot_mapping: torch.Tensor, index_key: torch.Tensor, *,
                    inplace: bool) -> torch.Tensor: ...
@overload
def write_index_key(index_cache: FP8IndexCache, slot_mapping: torch.Tensor, index_key: torch.Tensor, *,
                    inplace: bool) -> FP8IndexCache: ...


def write_index_key(
    index_cache: IndexCache,
    slot_mapping: torch.Tensor,
    index_key: torch.Tensor,
    *,
    inplace: bool,
) -> IndexCache:
    """Write each row's indexer key into the paged indexer cache.

    index_cache:  [num_blocks, bs, Di], or an `FP8IndexCache` (each key quantized as
                  `reference.dsa.quantize_index_keys` does, bit for bit)
    slot_mapping: [T] int64 (int32 accepted), slot = block * bs + offset; -1 skips the row
    index_key:    [T, Di] (any strides; cast to the cache dtype)
    returns       the cache with the rows written: `index_cache` itself when `inplace`,
                  else a copy (the input left untouched).
    """
    check_shape("slot_mapping", slot_mapping, (None,))
    check_shape("index_cache", index_cache, (None, None, None))
    check_shape("index_key", index_key, (slot_mapping.shape[0], index_cache.shape[2]))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_float("index_key", index_key)
    if isinstance(index_cache, torch.Tensor):
        check_float("index_cache", index_cache)
        check_same_device(index_cache=index_cache, slot_mapping=slot_mapping, index_key=index_key)
        # The latent cache's writer already skips -1 slots and casts to the cache dtype.
        return write_kv(index_cache, slot_mapping, index_key, inplace=inplace)
    check_same_device(index_cache=index_cache.values, slot_mapping=slot_mapping, index_key=index_key)
    if not inplace:
        index_cache = FP8IndexCache(values=index_cache.values.clone(), scales=index_cache.scales.clone())
    num_rows, head_dim = index_key.shape
    if num_rows:
        values, scales = index_cache.values, index_cache.scales
        use_pdl = pdl(index_key.device)
        _write_fp8_key_kernel[(num_rows,)](
            index_key, slot_mapping, values, scales,
            num_rows, head_dim, values.shape[1],
            *index_key.stride(), slot_mapping.stride(0), *values.stride(), scales.stride(0), scales.stride(1),
            BLOCK_D=max(16, next_pow2(head_dim)), GDC=use_pdl, num_warps=1, launch_pdl=use_pdl,
        )
    return index_cache


@dataclass(frozen=True, slots=True)
class IndexerConfig:
    """Tile sizes of the scoring kernel: keys per step, warps, pipeline depth, and the tiles whose
    pages are looked up at once (0: each tile's with its keys); wgmma: the warpgroup-MMA kernel
    (`gluon.dsa_indexer`) where it applies, these tiles elsewhere."""

    block_n: int
    num_warps: int
    num_stages: int
    locate_tiles: int = 0
    wgmma: bool = False


# 64 heads x 128 dims: a [64, 64] fp32 product tile per step is 32 registers a
# thread at 4 warps, and five 16 KB key tiles in flight hide the gather latency.
# Swept on an H200 at B64 x 32K / 128K: 85% / 87% of copy bandwidth, where
# 128 keys a step at 8 warps and 3 stages gave 77% / 75%.
_GPU_CONFIG = IndexerConfig(block_n=64, num_warps=4, num_stages=5, wgmma=True)
# Chunks of at most 16 tiles (few rows: each row in many chunks) look their pages up at once,
# in one group of tiles. H200, 64 heads, us: B8 x 128K (16 tiles a chunk) 77.3 against 80.6,
# B1 x 128K (8) 11.1 against 15.5; at B64 x 32K (30 tiles, two groups) 154 against 146
# (bench/results/dsa-kernels/h200/logs-archive/indexer-locate-sweep-h200-2026-11-24.log).
_GPU_SHORT_CHUNKS = IndexerConfig(block_n=64, num_warps=4, num_stages=4, locate_tiles=16, wgmma=True)
# Chunks of 17 to 32 tiles look theirs up in one group of 32. H200, B8 x 128K in 64 chunks
# of 2K keys: 72.4 us (87% of copy), where 132 chunks of 1K (the short ones' config) took
# 77.2; B64 x 32K in 17 chunks of ~30 tiles 145.7 against 144.4 without the lookup
# (bench/results/dsa-kernels/h200/logs-archive/indexer-chunks-sweep-h200-2026-11-26.log).
_GPU_MEDIUM_CHUNKS = IndexerConfig(block_n=64, num_warps=4, num_stages=4, locate_tiles=32, wgmma=True)
_INTERPRETER_CONFIG = IndexerConfig(block_n=16, num_warps=4, num_stages=1)

# Programs per multiprocessor aimed for: several waves, so rows of unequal key
# counts (and a partial last wave) cost little; chunks never shorter than
# _MIN_KEYS_PER_CHUNK, below which the query reload outweighs the parallelism.
_WAVES = 8
_MIN_KEYS_PER_CHUNK = 512
# Where rows of chunks this long still have _LONG_ROW_CHUNKS of them each, and the programs
# give every multiprocessor two (the most resident), chunks are no shorter: a program's
# query load and pipeline fill then weigh half as much (B8 x 128K, above). Rows of fewer
# such chunks keep the shorter ones: V4's CSA indexer at B64 over 16K entries in 8 chunks
# of 2K made v4-mini's step 2.14 ms against 2.11 in 17 (bench/results/dsa-kernels/h200/logs-archive/v4-long-chunks-ab-h200-2026-11-26.log).
_LONG_CHUNK_KEYS = 2048
_LONG_ROW_CHUNKS = 32
# When those chunks are fewer than one wave (a batch of one or a few rows, V4's
# compressed entries), shorter ones fill it: one row of 2K / 16K keys in 16 / 128
# chunks of 128 takes 5.7 / 6.1 us instead of 12 (H100,
# bench/results/dsa-kernels/h100/logs-archive/indexer-small-h100-2026-11-23.log). Where chunks of 512 already
# fill a wave, shorter ones lose to the queries' reloads (B64 x 2K: 18.6 vs 14.8 us).
_MIN_KEYS_PER_SHORT_CHUNK = 128


def indexer_config(device: torch.device, keys_per_chunk: int | None = None) -> IndexerConfig:
    """The scoring kernel's tiles on `device`, for chunks of keys_per_chunk keys where known."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    for located in (_GPU_SHORT_CHUNKS, _GPU_MEDIUM_CHUNKS):
        if keys_per_chunk is not None and keys_per_chunk <= located.locate_tiles * located.block_n:
            return located
    return _GPU_CONFIG


def default_config(num_rows: int, num_cols: int, device: torch.device | str) -> IndexerConfig:
    """The tiles `index_scores` takes for [num_rows, num_cols] scores when given none: by the length of the
    chunks the rows split into (the GPU configurations all step 64 keys, so the chunking holds for each)."""
    device = torch.device(device)
    tiles = indexer_config(device)
    chunks = index_scores_num_chunks(num_rows, num_cols, device, tiles)
    return indexer_config(device, triton.cdiv(triton.cdiv(max(1, num_cols), chunks), tiles.block_n) * tiles.block_n)


def index_scores_num_chunks(num_rows: int, num_cols: int, device: torch.device | str,
                            config: IndexerConfig | None = None) -> int:
    """Chunks per row: depends only on static shapes and the device's multiprocessor count."""
    device = torch.device(device)
    config = config or indexer_config(device)
    num_rows = max(1, num_rows)
    wanted = triton.cdiv(_WAVES * sm_count(device), num_rows)
    if device.type != "cuda":
        return max(1, min(wanted, triton.cdiv(num_cols, config.block_n)))
    long_chunks = max(1, min(wanted, triton.cdiv(num_cols, _LONG_CHUNK_KEYS)))
    if long_chunks >= _LONG_ROW_CHUNKS and num_rows * long_chunks >= 2 * sm_count(device):
        return long_chunks
    chunks = max(1, min(wanted, triton.cdiv(num_cols, _MIN_KEYS_PER_CHUNK)))
    if num_rows * chunks < sm_count(device):
        one_wave = triton.cdiv(sm_count(device), num_rows)
        chunks = max(chunks, min(one_wave, triton.cdiv(num_cols, _MIN_KEYS_PER_SHORT_CHUNK)))
    return chunks


@triton.jit
def _score_tile(q, weights, rows, scale_rows, pos, key_mask, out_row, s_cd, s_oj,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """Scores of one tile of keys (row pointers [BLOCK_N]; with FP8, of e4m3 keys whose scales are at
    scale_rows [BLOCK_N]) against the row's queries [BLOCK_H, BLOCK_D]."""
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        k_mask = key_mask[:, None]
    else:
        k_mask = key_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    keys = tl.load(rows[:, None] + offs_d[None, :] * s_cd, mask=k_mask, other=0.0)
    if FP8:
        # e4m3 values are exact in any of the queries' dtypes; the key's scale multiplies its logits
        # after the product (relu(s x) = s relu(x) for the positive scales the write makes).
        keys = keys.to(q.dtype)
    # Keys as the product's rows: the sum over heads then runs along the
    # accumulator's columns, inside each warp, not across warps.
    logits = tl.dot(keys, tl.trans(q), input_precision=DOT_PRECISION)          # [BLOCK_N, BLOCK_H]
    if FP8:
        logits = logits * tl.load(scale_rows, mask=key_mask, other=0.0)[:, None]
    score = tl.sum(tl.maximum(logits, 0.0) * weights[None, :], axis=1)         # [BLOCK_N]
    tl.store(out_row + pos * s_oj, score, mask=key_mask)


@triton.jit(do_not_specialize=["num_cols", "keys_per_chunk"])
def _index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scale_ptr, bt_ptr, key_lens_ptr, out_ptr,
    weight_scale, num_heads, num_cols, keys_per_chunk,
    s_qt, s_qh, s_qd, s_wt, s_wh,
    s_cn, s_cb, s_cd, s_sn, s_sb, s_btt, s_btw, s_kl, s_ot, s_oj,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, GDC: tl.constexpr, LOCATE_TILES: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    key_len = tl.minimum(tl.maximum(tl.load(key_lens_ptr + t * s_kl), 0), num_cols)
    start = chunk * keys_per_chunk
    end = tl.minimum(start + keys_per_chunk, num_cols)
    visible_end = tl.minimum(end, key_len)

    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    t64 = t.to(tl.int64)
    if BLOCK_D == HEAD_DIM:
        q_mask = head_mask[:, None]
    else:
        q_mask = head_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + t64 * s_qt + heads[:, None] * s_qh + offs_d[None, :] * s_qd, mask=q_mask, other=0.0)
    # Heads past num_heads weigh 0, so their zero scores add nothing. The scale is applied
    # as torch's float32 product would (one rounding), where a launch of its own took 1.1 us.
    weights = tl.load(w_ptr + t64 * s_wt + heads * s_wh, mask=head_mask, other=0.0) * weight_scale
    bt_row = bt_ptr + t64 * s_btt
    out_row = out_ptr + t64 * s_ot

    if LOCATE_TILES == 0:
        for n0 in range(start, visible_end, BLOCK_N):
            pos = n0 + offs_n
            key_mask = pos < visible_end
            page = tl.load(bt_row + (pos // PAGE_SIZE) * s_btw, mask=key_mask, other=0).to(tl.int64)
            _score_tile(q, weights, cache_ptr + page * s_cn + (pos % PAGE_SIZE) * s_cb,
                        scale_ptr + page * s_sn + (pos % PAGE_SIZE) * s_sb, pos, key_mask, out_row,
                        s_cd, s_oj, HEAD_DIM, BLOCK_D, DOT_PRECISION, FP8)
    else:
        # The pages of LOCATE_TILES tiles are looked up at once, so the key loads of the
        # inner loop depend only on registers and the loop counter (as in `dsa_decode`).
        tile_ids = tl.arange(0, LOCATE_TILES)
        for c0 in range(start, visible_end, LOCATE_TILES * BLOCK_N):
            located = c0 + tile_ids[:, None] * BLOCK_N + offs_n[None, :]
            pages = tl.load(bt_row + (located // PAGE_SIZE) * s_btw, mask=located < visible_end, other=0)
            for j in range(0, tl.minimum(LOCATE_TILES, tl.cdiv(visible_end - c0, BLOCK_N))):
                pos = c0 + j * BLOCK_N + offs_n
                page = tl.sum(tl.where(tile_ids[:, None] == j, pages, 0), axis=0).to(tl.int64)
                _score_tile(q, weights, cache_ptr + page * s_cn + (pos % PAGE_SIZE) * s_cb,
                            scale_ptr + page * s_sn + (pos % PAGE_SIZE) * s_sb, pos,
                            pos < visible_end, out_row, s_cd, s_oj, HEAD_DIM, BLOCK_D, DOT_PRECISION, FP8)
    hidden = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for n0 in range(tl.maximum(start, key_len), end, BLOCK_N):
        pos = n0 + offs_n
        tl.store(out_row + pos * s_oj, hidden, mask=pos < end)


def index_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: IndexCache,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    *,
    weight_scale: float = 1.0,
    out: torch.Tensor | None = None,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """Indexer scores of every position of each row's paged indexer cache.

    q:            [T, Hi, Di] indexer queries (any strides), bf16 / fp16 / fp32
    head_weights: [T, Hi] float32
    weight_scale: the scores' constant factor, applied to head_weights (in float32)
    index_cache:  [num_blocks, bs, Di], same dtype as q, or an `FP8IndexCache` (e4m3 keys read as such, each
                  key's scores times its scale)
    block_table:  [T, W] int32, one table per row
    key_lens:     [T] int32 keys the row sees (clamped to [0, W * bs]); 0 marks a padded row
    out:          [T, W * bs] float32 to write into (a captured graph allocates nothing), or None
    config:       overrides the tiles (tests, benchmark sweeps); `default_config`'s otherwise, which take the
                  warpgroup-MMA kernel (`gluon.dsa_indexer`) on Hopper where it applies
    returns       scores [T, W * bs] float32: sum_h w[t, h] * relu(q[t, h] . key_j), w = head_weights * weight_scale
                  (products and sums in float32) for j < key_lens[t], -inf after.
    """
    num_rows, num_heads, head_dim = q.shape
    _, block_size, _ = index_cache.shape
    check_shape("head_weights", head_weights, (num_rows, num_heads))
    check_shape("index_cache", index_cache, (None, None, head_dim))
    check_shape("block_table", block_table, (num_rows, None))
    check_shape("key_lens", key_lens, (num_rows,))
    check_float("q", q)
    check_dtype("head_weights", head_weights, (torch.float32,))
    fp8 = isinstance(index_cache, FP8IndexCache)
    if isinstance(index_cache, FP8IndexCache):
        keys, scales = index_cache.values, index_cache.scales
    else:
        keys = scales = index_cache
        check_dtype("index_cache", keys, (q.dtype,))
    check_dtype("block_table", block_table, (torch.int32,))
    check_dtype("key_lens", key_lens, (torch.int32,))
    check_same_device(q=q, head_weights=head_weights, index_cache=keys, block_table=block_table,
                      key_lens=key_lens)
    num_cols = block_table.shape[1] * block_size
    if out is None:
        out = torch.empty((num_rows, num_cols), dtype=torch.float32, device=q.device)
    else:
        check_shape("out", out, (num_rows, num_cols))
        check_dtype("out", out, (torch.float32,))
        check_same_device(q=q, out=out)
    if num_rows == 0 or num_cols == 0:
        return out
    device = q.device
    config = config or default_config(num_rows, num_cols, device)
    chunks = index_scores_num_chunks(num_rows, num_cols, device, config)
    keys_per_chunk = triton.cdiv(triton.cdiv(num_cols, chunks), config.block_n) * config.block_n
    chunks = triton.cdiv(num_cols, keys_per_chunk)
    use_pdl = pdl(device)
    if config.wgmma and gluon_indexer.applies(q, index_cache):
        return gluon_indexer.index_scores_wgmma(q, head_weights, index_cache, block_table, key_lens, out,
                                                weight_scale=weight_scale, sm_count=sm_count(device), use_pdl=use_pdl)
    _index_scores_kernel[(num_rows, chunks)](
        # Without FP8 keys the scale pointer is the cache's, never read.
        q, head_weights, keys, scales, block_table, key_lens, out,
        float(weight_scale), num_heads, num_cols, keys_per_chunk,
        *q.stride(), *head_weights.stride(),
        *keys.stride(), scales.stride(0), scales.stride(1), *block_table.stride(), key_lens.stride(0), *out.stride(),
        HEAD_DIM=head_dim, BLOCK_H=max(16, next_pow2(num_heads)), BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=config.block_n, PAGE_SIZE=block_size,
        DOT_PRECISION=dot_precision(q.dtype), GDC=use_pdl, LOCATE_TILES=config.locate_tiles, FP8=fp8,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    return out
