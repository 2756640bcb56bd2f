"""Sparse absorbed MLA over selected positions of the paged latent cache: split flash decoding.

Every row (a decode token or a prompt token alike) attends over the k positions
its indexer selected. Stage 1 gives each (row, head group, split) program one
contiguous slice of the row's index list. It first looks up the pages of its
indices in the row's block table, 8 tiles' worth at once; then, per tile of
BLOCK_N indices, it gathers the whole 576-wide latent rows
(each one contiguous, so every row is one coalesced read), and runs the online
softmax with the scores and the value product on tensor cores (below 64 heads a
program, the latent's columns in four chunks, each with a query slice, a score
product and an accumulator of its own); stage 2 merges the splits by LSE
(`decode_merge`, the kernels of dense decode, W_UV included at up to 2 rows, a 16-bit
weight or a stacked FP8 pair alike).

On Hopper, Gluon kernels take stage 1 where they apply (`sparse_launch_config`): the warpgroup-MMA
decode from 64 heads a row (`gluon.mla_decode`), and the keys-as-rows one up to 16 heads over a 16-bit
cache (`gluon.dsa_decode_narrow`); this kernel is their twin.

An FP8 latent cache is read by the same kernel, each chunk of latent values
dequantized as it is loaded (`latent_parts.latent_values`); the RoPE values are
read as stored.

Indices of -1 (and any outside the block table) are masked keys: a tile of them
reads nothing, and a row with none valid writes out 0 and lse -inf. The split
count is a function of static shapes and the device only
(`sparse_mla_decode_num_splits`), so a captured graph stays valid for any indices.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..gluon import dsa_decode_narrow as gluon_narrow
from ..gluon import mla_decode as gluon_decode
from ..latent_cache import LatentCache
from ..quantized import BlockFP8Weight
from ._common import LOG2E, dot_precision, next_pow2, pdl
from .decode import (DecodeConfig, check_gluon_takes, check_latent_attention_args, decode_config, fill_splits,
                     launch_config, workspace_splits)
from .decode_merge import merge_splits, merge_splits_value, project_values, split_partials
from .latent_chunks import attend_tile, chunked_queries, store_split
from .latent_parts import LatentParts, latent_parts

# 16 heads: 64-key tiles in two stages (H200, C=512, R=64, top-2048, latent in four chunks:
# B64 x 32K 53.5 us, against 55.5 with 32-key tiles in three stages and 59.2 for the kernel
# before the chunks; bench/results/dsa-kernels/h200/logs-archive/sparse-chunks-sweep-h200-2026-11-26.log). 64+ heads:
# 64-key tiles read for 64 heads at once (H100, 229 us vs 365 us with 32-key tiles at 128
# heads; bench/results/dsa-kernels/h100/logs-archive/dsa-sweep-h100-2026-11-23.log). Other head counts take the dense
# decode's tiles.
_GPU_CONFIGS = MappingProxyType({16: DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2),
                                 64: DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)})
# Below 64 heads a program's tiles are narrower than Hopper's warpgroup MMA, and the latent's
# columns are taken in four chunks (the kernel's accumulators a0..a3), each with its own query
# slice, score product and value accumulator: a score is then four MMA chains a quarter as deep,
# which run side by side, where one 512-deep chain waited on each product in turn. From 64 heads
# the warpgroup MMA takes the whole row: chunked, 64 heads at B64 x 32K took 124 us against 108,
# 128 heads 203 against 182 (bench/results/dsa-kernels/h200/logs-archive/sparse-chunks-ab-h200-2026-11-26.log).
_LATENT_CHUNKS = 4
# Up to 16 heads over a 16-bit cache on Hopper: the keys-as-rows kernel (`gluon.dsa_decode_narrow`; its tiles
# are its own: 16 heads, 64-key tiles, one warpgroup, two stages, one program a multiprocessor), from
# _NARROW_MIN_SLOTS index slots in all (rows x k). H200, 16 heads, top-2048 over 128K, both stages, us, this
# kernel / the `tl.dot` one: 1 row 9.0-9.2 / 8.3-8.5, 4 rows 10.6-10.8 / 9.9-10.0 (a split of one tile each),
# 8 rows 14.3-14.5 / 15.2-15.3, 16 rows 20.1-20.3 / 24.1-24.2, 64 rows 49.0-49.2 / 54.2-54.4, 128 rows 85.7 /
# 93.1-94.9, 1024 rows 632 / 619-634 (bench/results/dsa-kernels/h200/logs-archive/sparse-narrow-h200-2026-11-29.log).
_NARROW_CONFIG = DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, narrow=True, programs_per_sm=1)
_NARROW_MIN_SLOTS = 8 * 2048
_WHOLE_ROW_MIN_BLOCK_H = 64
# Splits fill about two programs per multiprocessor and no more (a partial second
# wave runs at a fraction of the bandwidth); no split takes fewer than
# _MIN_KEYS_PER_SPLIT indices. At few rows the gathers' latency, not the partial
# results, bounds a split: H200, 16 heads, top-2048 with W_UV, 8 rows 31.9 us with
# 8 splits of 256 and 25.8 with 32 of 64; one row 24.8 / 13.5 us; 16 rows equal at 8
# and 16 (bench/results/dsa-kernels/h200/logs-archive/sparse-splits-h200-2026-11-24.log).
_MIN_KEYS_PER_SPLIT = 64
_MAX_SPLITS = 32
# Up to this many rows stage 2 also applies W_UV; more rows merge, then take one GEMM over the
# heads. H200, 16 heads, top-2048, both stages, us fused / GEMM: 1 row 10.4 / 11.5, 2 rows
# 11.8 / 12.1, 4 rows 15.4 / 13.3, 8 rows 20.0 / 18.9 (bench/results/dsa-kernels/h200/logs-archive/sparse-chunks-ab-h200-2026-11-26.log).
_FUSED_VALUE_MAX_ROWS = 2
# Index slots located at once (index, then page) before their tiles are read: 8 tiles of
# 32, a split of 512 in two rounds. H200, 16 heads, us: B64 x 32K 55.0 (16 tiles 58.3, 32
# tiles 64.4, spilling), B8 x 128K with W_UV 20.5 (22.0, 23.7); locating one tile ahead
# inside the loop was 68 at B64 (bench/results/dsa-kernels/h200/logs-archive/sparse-locate-sweep-h200-2026-11-23.log,
# bench/results/dsa-kernels/h200/logs-archive/sparse-tiles-sweep-h200-2026-11-24.log).
_LOCATE_TILES = 8


def sparse_launch_config(num_heads: int, kv_lora_rank: int, rope_dim: int, device: torch.device, fp8: bool,
                         dtype: torch.dtype, *, wgmma: bool = True, slots: int | None = None) -> DecodeConfig:
    """`sparse_mla_decode`'s tiles, from static shapes and the device:

    * the warpgroup-MMA kernel's where it applies (`gluon.mla_decode.applies`, at 64 heads a row and more: the
      dense decode's `decode._WGMMA_CONFIG`);
    * up to 16 heads a row over a 16-bit cache, the keys-as-rows kernel's (`_NARROW_CONFIG`,
      `gluon.dsa_decode_narrow.applies`), unless `slots` (rows x k; None: no bound) is below `_NARROW_MIN_SLOTS`;
    * else `sparse_decode_config`'s (the `tl.dot` kernel's).

    wgmma False takes the `tl.dot` kernel in every case (the twin, which tests and benchmarks set beside the
    Gluon kernels)."""
    if wgmma and gluon_decode.applies(num_heads, 1, kv_lora_rank, rope_dim, dtype, device):
        return launch_config(num_heads, 1, kv_lora_rank, rope_dim, device, fp8, dtype)
    if (wgmma and gluon_narrow.applies(num_heads, kv_lora_rank, rope_dim, dtype, fp8, device)
            and (slots is None or slots >= _NARROW_MIN_SLOTS)):
        return _NARROW_CONFIG
    return sparse_decode_config(num_heads, device)


def sparse_op_config(q: torch.Tensor, kv_cache: LatentCache, kv_lora_rank: int, *,
                     slots: int | None) -> DecodeConfig:
    """The tiles `sparse_mla_decode` takes when it is given none, for the queries q [T, H, C + R] over kv_cache:
    `sparse_launch_config` with the Gluon kernels only over rows `cp.async` can gather. slots: rows x k, as the op
    passes it; None picks one kernel for every row count (the batch-invariant op's choice, so that a row's answer
    does not depend on how many rows share its step)."""
    return _op_config(q, latent_parts(kv_cache, kv_lora_rank), slots)


def _op_config(q: torch.Tensor, parts: LatentParts, slots: int | None) -> DecodeConfig:
    kv_lora_rank = parts.values.shape[2]
    return sparse_launch_config(q.shape[1], kv_lora_rank, q.shape[2] - kv_lora_rank, q.device, parts.fp8, q.dtype,
                                wgmma=gluon_decode.copyable(parts.values, parts.rope), slots=slots)


def sparse_decode_config(num_heads: int, device: torch.device) -> DecodeConfig:
    """The `tl.dot` kernel's tiles for `num_heads` heads a row on `device`."""
    if device.type == "cuda":
        tuned = _GPU_CONFIGS.get(min(64, next_pow2(num_heads)))
        if tuned is not None:
            return tuned
    return decode_config(num_heads, device)


def sparse_mla_decode_num_splits(num_rows: int, num_heads: int, top_k: int, device: torch.device | str,
                                 config: DecodeConfig | None = None) -> int:
    """Splits per row: depends only on static shapes and the device's multiprocessor count."""
    device = torch.device(device)
    config = config or sparse_decode_config(num_heads, device)
    programs = max(1, num_rows) * triton.cdiv(num_heads, config.block_h)
    return fill_splits(programs, top_k, device, min_keys=_MIN_KEYS_PER_SPLIT, max_splits=_MAX_SPLITS,
                       interpreter_min_keys=config.block_n, programs_per_sm=config.programs_per_sm)


def sparse_mla_decode_workspace(num_rows: int, num_heads: int, kv_lora_rank: int, top_k: int,
                                device: torch.device | str, config: DecodeConfig | None = None,
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials for `sparse_mla_decode(..., workspace=...)`, to allocate once per static shape.

    config: the tiles `sparse_mla_decode` will take: when it is given none, `sparse_op_config(q, kv_cache,
    kv_lora_rank, slots=T * k)` for the queries and cache it will get (the split count follows the kernel, so a
    workspace sized for another kernel's splits runs those splits); None: `sparse_decode_config`'s
    returns (partial_out [T, H, S, C] float32, partial_lse [T, H, S] float32),
    S = sparse_mla_decode_num_splits(T, H, k, device, config).
    """
    splits = sparse_mla_decode_num_splits(num_rows, num_heads, top_k, device, config)
    return (torch.empty((num_rows, num_heads, splits, kv_lora_rank), dtype=torch.float32, device=device),
            torch.empty((num_rows, num_heads, splits), dtype=torch.float32, device=device))


@triton.jit
def _cache_slots(idx_row, bt_row, slot, end, num_positions, s_ik, s_btw, PAGE_SIZE: tl.constexpr):
    """Cache slots (page * PAGE_SIZE + offset) of the index slots `slot` (< end); -1 where no valid key."""
    pos = tl.load(idx_row + slot * s_ik, mask=slot < end, other=-1)
    valid = (pos >= 0) & (pos < num_positions)
    page = tl.load(bt_row + (pos // PAGE_SIZE) * s_btw, mask=valid, other=0).to(tl.int64)
    return tl.where(valid, page * PAGE_SIZE + pos % PAGE_SIZE, -1)


# The split count follows the row count, which eager steps vary: as a constexpr
# or a specialised int it would compile a kernel per count mid-run.
@triton.jit(do_not_specialize=["num_splits", "top_k", "num_positions", "s_plh"])
def _sparse_split_kernel(
    q_ptr, v_ptr, sc_ptr, r_ptr, bt_ptr, idx_ptr, po_ptr, pl_ptr,
    num_heads, num_splits, top_k, num_positions, scale_log2,
    s_qt, s_qh, s_qd,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_btt, s_btw, s_it, s_ik,
    s_pot, s_poh, s_pos, s_pod,
    s_plt, s_plh, s_pls,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, GDC: tl.constexpr, LOCATE_TILES: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    # Whole tiles of indices per split, so only a split's last tile is ragged.
    slots_per_split = tl.cdiv(tl.cdiv(top_k, num_splits), BLOCK_N) * BLOCK_N
    start = split * slots_per_split
    end = tl.minimum(start + slots_per_split, top_k)

    t64 = t.to(tl.int64)
    heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_n = tl.arange(0, BLOCK_N)
    q_row = q_ptr + t64 * s_qt + heads[:, None] * s_qh
    q0, q1, q2, q3, q_pe = chunked_queries(q_row, head_mask, s_qd, KV_LORA_RANK, ROPE_DIM, CHUNK, BLOCK_R, CHUNKS)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    a0 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    if CHUNKS == 4:
        a1 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
        a3 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    else:
        # One chunk: the other slots only pass through the tile function (and compile away).
        a1, a2, a3 = a0, a0, a0
    bt_row = bt_ptr + t64 * s_btt
    idx_row = idx_ptr + t64 * s_it
    # Each chunk's index and page loads happen once, up front: the row loads of the
    # inner loop then depend only on registers and the loop counter, so they are
    # prefetched stages ahead instead of waiting on two dependent loads a tile.
    tile_ids = tl.arange(0, LOCATE_TILES)
    for c0 in range(start, end, LOCATE_TILES * BLOCK_N):
        slots = c0 + tile_ids[:, None] * BLOCK_N + offs_n[None, :]
        cache_slots = _cache_slots(idx_row, bt_row, slots, end, num_positions, s_ik, s_btw, PAGE_SIZE)
        for j in range(0, tl.minimum(LOCATE_TILES, tl.cdiv(end - c0, BLOCK_N))):
            cache_slot = tl.sum(tl.where(tile_ids[:, None] == j, cache_slots, 0), axis=0)
            key_mask = cache_slot >= 0
            cache_slot = tl.maximum(cache_slot, 0)
            # Page and in-page offset times their strides (not one flat offset), so the
            # compiler keeps the strides' alignment and copies rows asynchronously.
            page = cache_slot // PAGE_SIZE
            offset = cache_slot % PAGE_SIZE
            m_i, l_i, a0, a1, a2, a3 = attend_tile(
                q0, q1, q2, q3, q_pe, v_ptr + page * s_vn + offset * s_vb, sc_ptr + page * s_scn + offset * s_scb,
                r_ptr + page * s_rn + offset * s_rb, key_mask, m_i, l_i, a0, a1, a2, a3, scale_log2,
                s_vd, s_scd, s_rd,
                KV_LORA_RANK, ROPE_DIM, CHUNK, BLOCK_R, CHUNKS, DOT_PRECISION, FP8)

    store_split(po_ptr + t64 * s_pot + heads[:, None] * s_poh + split * s_pos,
                pl_ptr + t64 * s_plt + heads * s_plh + split * s_pls, m_i, l_i, a0, a1, a2, a3, head_mask, s_pod,
                KV_LORA_RANK, CHUNK, CHUNKS)


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
    w_uv: torch.Tensor | BlockFP8Weight | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of each row over the positions `indices` selects.

    q:           [T, H, C + R] absorbed query (any strides), bf16 / fp16 / fp32
    kv_cache:    [num_blocks, bs, C + R] latent cache, same dtype as q, or an `FP8LatentCache`
                 whose RoPE values have q's dtype (read dequantized)
    block_table: [T, W] int32, one table per row
    indices:     [T, k] int32 positions into the row's table; -1 = none (and so is
                 any position outside [0, W * bs))
    w_uv:        [H, Dv, C] value up-projection in q's dtype (any strides), a stacked FP8 pair
                 (read dequantized into q's dtype), or None
    workspace:   (partial_out [T, H, S, C] fp32, partial_lse [T, H, S] fp32) from
                 `sparse_mla_decode_workspace`, so a captured graph allocates only its
                 outputs; None allocates it here. Its S is the split count. Unused when S == 1.
    num_splits:  overrides `sparse_mla_decode_num_splits` (tests); must match the workspace
    config:      overrides the tile sizes (benchmark sweeps)
    returns      out [T, H, C] in q's dtype, or with w_uv [T, H, Dv] = (out rounded to q's
                 dtype) @ w_uv[h]^T; lse [T, H] float32 natural log. A row with no valid
                 index gives out 0 and lse -inf.
    """
    num_rows, num_heads, dim = q.shape
    _, block_size, _ = kv_cache.shape
    parts = check_latent_attention_args(q, kv_cache, block_table, kv_lora_rank, w_uv, num_seqs=num_rows,
                                        indices=indices)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
    top_k = indices.shape[1]
    device = q.device
    config = config or _op_config(q, parts, num_rows * top_k)
    splits = num_splits or workspace_splits(workspace) or sparse_mla_decode_num_splits(num_rows, num_heads, top_k,
                                                                                    device, config)
    fused_value = w_uv is not None and num_rows <= _FUSED_VALUE_MAX_ROWS

    out = torch.empty((num_rows, num_heads, kv_lora_rank), dtype=q.dtype, device=device)
    lse = torch.empty((num_rows, num_heads), dtype=torch.float32, device=device)
    if num_rows == 0:
        return (out if w_uv is None else project_values(out, w_uv)), lse
    # One split is the whole answer: stage 1 writes the outputs and stage 2 is skipped.
    partial_out, partial_lse = split_partials(out, lse, splits, direct=splits == 1 and not fused_value,
                                              workspace=workspace)

    use_pdl = pdl(device)
    chunks = 1 if config.block_h >= _WHOLE_ROW_MIN_BLOCK_H else _LATENT_CHUNKS
    grid = (num_rows, triton.cdiv(num_heads, config.block_h), splits)
    if config.wgmma:
        check_gluon_takes(q, parts, 1, config)
        gluon_decode.wgmma_sparse_split_decode(q, parts.values, parts.rope, block_table, indices, partial_out,
                                               partial_lse, softmax_scale_log2=softmax_scale * LOG2E,
                                               scales=parts.scales if parts.fp8 else None)
    elif config.narrow:
        _check_narrow_takes(q, parts)
        gluon_narrow.narrow_sparse_split_decode(q, parts.values, parts.rope, block_table, indices, partial_out,
                                                partial_lse, softmax_scale_log2=softmax_scale * LOG2E)
    else:
        _sparse_split_kernel[grid](
            q, *parts.pointers(), block_table, indices, partial_out, partial_lse,
            num_heads, splits, top_k, block_table.shape[1] * block_size, softmax_scale * LOG2E,
            *q.stride(), *parts.strides(), *block_table.stride(), *indices.stride(),
            *partial_out.stride(), *partial_lse.stride(),
            KV_LORA_RANK=kv_lora_rank, ROPE_DIM=dim - kv_lora_rank,
            # Chunks of at least 16 columns, the smallest tensor-core product.
            CHUNK=max(16, next_pow2(kv_lora_rank) // chunks), CHUNKS=chunks,
            BLOCK_R=max(16, next_pow2(dim - kv_lora_rank)),
            BLOCK_H=config.block_h, BLOCK_N=config.block_n, PAGE_SIZE=block_size,
            DOT_PRECISION=dot_precision(q.dtype), GDC=use_pdl, LOCATE_TILES=_LOCATE_TILES, FP8=parts.fp8,
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
        )
    if fused_value and w_uv is not None:
        out = torch.empty((num_rows, num_heads, w_uv.shape[1]), dtype=q.dtype, device=device)
        merge_splits_value(partial_out, partial_lse, w_uv, out, lse, use_pdl)
        return out, lse
    if splits > 1:
        merge_splits(partial_out, partial_lse, out, lse, use_pdl)
    if w_uv is not None:
        out = project_values(out, w_uv)
    return out, lse


def _check_narrow_takes(q: torch.Tensor, parts: LatentParts) -> None:
    # Refuses, naming what does not fit, a sparse decode a config sends to the keys-as-rows kernel that cannot
    # take it (`gluon.dsa_decode_narrow.applies`, rows `cp.async` can gather). q [T, H, C + R]; parts: the cache's
    # leaves.
    num_heads, dim = q.shape[1], q.shape[2]
    kv_lora_rank = parts.values.shape[2]
    if not (gluon_narrow.applies(num_heads, kv_lora_rank, dim - kv_lora_rank, q.dtype, parts.fp8, q.device)
            and gluon_decode.copyable(parts.values, parts.rope)):
        raise ValueError(f"config: the keys-as-rows sparse kernel takes bf16/fp16 queries of at most "
                         f"{gluon_narrow.BLOCK_H} heads a row over a 16-bit cache with kv_lora_rank="
                         f"{gluon_decode.KV_LORA_RANK}, rope {gluon_decode.ROPE_DIM} and rows of 16-byte aligned "
                         f"contiguous columns on a Hopper GPU, got {q.dtype}, {num_heads} heads, "
                         f"{'an FP8' if parts.fp8 else 'a plain'} cache, kv_lora_rank={kv_lora_rank}, rope "
                         f"{dim - kv_lora_rank}, cache strides {tuple(parts.values.stride())} on {q.device}")


def sparse_decode_bytes(num_rows: int, num_heads: int, top_k: int, dim: int, kv_lora_rank: int,
                        itemsize: int) -> int:
    """Bytes a sparse decode must move: the selected latent rows, the queries and the outputs."""
    return itemsize * (num_rows * top_k * dim + num_rows * num_heads * (dim + kv_lora_rank))
