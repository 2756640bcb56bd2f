"""Absorbed MLA decode over the paged latent cache: split-KV flash decoding.

Stage 1 (here) gives every (sequence, head group, split) program one contiguous
slice of the sequence's keys and writes a normalised partial output and its LSE;
stage 2 (`decode_merge`) merges the splits by LSE. Given the value up-projection
W_UV (a 16-bit weight or a stacked FP8 pair), small batches merge and project in
one stage-2 kernel; larger ones project after it (`decode_merge.project_values`).
The number of splits is a function of static shapes and the device only
(`mla_decode_num_splits`), and each sequence divides its *actual* length among
them on the device, so a captured graph stays valid for any lengths and no step
waits on the host. An FP8 latent cache is read through the same kernel, its tiles
dequantized as they are loaded (`latent_parts.latent_tile`). On a GPU, one query a
row over a plain cache takes a twin of the split kernel whose latent columns come
in four chunks (`_chunked_split_kernel`, `latent_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import check_dtype, check_same_device, check_shape
from ..gluon import mla_decode as gluon_decode
from ..gluon import mla_decode_narrow as gluon_narrow
from ..latent_cache import LatentCache
from ..quantized import BlockFP8Weight
from ._common import LN2, LOG2E, check_float, dot_precision, next_pow2, pdl, sm_count
from .decode_merge import merge_splits, merge_splits_value, project_values, split_partials
from .fp8_heads import check_head_weight
from .latent_chunks import attend_tile, chunked_queries, store_split
from .latent_parts import LatentParts, check_latent_cache, latent_parts, latent_tile


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Tile sizes of the split kernel: heads per program, keys per step, warps, pipeline depth."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    # 4: one query a row takes the latent's columns in four chunks (`latent_chunks`; C a power of two of at
    # least 64); 1: the whole row in one product chain.
    chunks: int = 1
    # The Gluon kernel on Hopper's warpgroup MMA (`gluon.mla_decode`; its tiles are its own: 64 rows,
    # 64-key tiles, 8 warps, two stages), where `gluon.mla_decode.applies`.
    wgmma: bool = False
    # The Gluon kernel for few heads: keys as the products' rows, up to 16 heads a program, 64-key tiles, 4 warps;
    # dense over an FP8 cache `gluon.mla_decode_narrow` (one stage, two programs a multiprocessor) where its
    # `applies`, sparse over a 16-bit cache `gluon.dsa_decode_narrow` (two stages, one program a multiprocessor).
    narrow: bool = False
    # Programs that run on a multiprocessor at once: splits fill one wave of them (`mla_decode_num_splits`).
    programs_per_sm: int = 2
    # No split covers fewer keys of the table's capacity (`mla_decode_num_splits`; why 128, at
    # `_PROGRAMS_PER_SM`).
    min_keys: int = 128


# Chosen on an H100 by `bench/kernels.py --sweep` (bf16, C=512, R=64). At 16 heads
# the kernel streams keys, and two pipeline stages matter more than tile width
# (0.28 ms vs 0.45-0.56 ms unpipelined at B=128, 4K). At 128 heads it is nearly
# compute-bound: 64 heads a program reuse each key tile 4x more than 16 heads
# do (0.48 ms vs 0.71 ms at B=64, 4K), given 8 warps to hold the accumulator.
_GPU_CONFIGS = MappingProxyType({
    16: DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
    32: DecodeConfig(block_h=32, block_n=32, num_warps=4, num_stages=2),
    64: DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=2),
})
# Over an FP8 latent cache (where no Gluon kernel takes it) a tile is dequantized in registers before the
# products take it, so it wants other tiles; the heads a program takes stay the bf16 cache's. H100, B64 x
# 32K: at 16 heads 32-key tiles unpipelined, 1.10 ms (0.88 for the bf16 cache: slower still, the
# dequantization bounds it); at 128 heads 64-key tiles over 8 warps in two stages, 2.40 ms (3.44 for the
# bf16 cache; 3.47 with its tiles).
# 32 heads were not measured and keep the bf16 cache's tiles. At 16 heads a split runs its unpipelined
# tiles one after another, so splits as short as one tile pay at small batches: on an H200 with the W_UV
# merge (bench/results/kernels/h200/logs-archive/decode-splits-small-batches-h200-2026-11-28.log),
# B1 x 1K 10.3 us against 15.9 at the 128-key minimum, B4 x 1K 14.7 against 22.4, B1 x 4K 19.7 against
# 22.0, B16 x 1K 21.4 against 25.1; where the wave, not the length, sets the count, nothing changes.
_GPU_FP8_CONFIGS = MappingProxyType({
    16: DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1, min_keys=32),
    32: _GPU_CONFIGS[32],
    64: DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2),
})
# One query a row over a plain cache takes the latent's columns in four chunks (`_chunked_split_kernel`),
# whose product chains run side by side. H100, B64 x 32K (`bench/notes/kernels.md`): 16 heads 0.811 ms
# (98.8% of copy) against 0.904 for whole rows; 128 heads, 64 a program, three stages, 2.49 ms
# (234 TFLOP/s) against 3.47 (128 heads a program, or 32-key tiles, ran slower). An FP8 cache keeps
# whole rows: chunked, its dequantization ran slower still (1.43 ms at 16 heads, 2.81 at 128). 32 heads
# were not measured and keep whole rows.
_GPU_CHUNKED_CONFIGS = MappingProxyType({
    16: DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, chunks=4),
    64: DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, chunks=4),
})
# 16-bit queries over a cache of C = 512, R = 64 (plain or FP8) with at least 64 rows (heads x queries) a
# sequence take the warpgroup-MMA kernel on Hopper (`gluon.mla_decode`), 64 rows a program as the chunked
# kernel at 128 heads. Over an FP8 cache it widens the tiles in shared memory: 1.23x faster than the `tl.dot`
# kernel at B64 x 32K, 128 and 64 heads, on an H200 (bench/notes/fp8.md).
# Its shared memory (216 KiB) leaves room for one program a multiprocessor, so its splits fill one wave of
# one program each: at B64 x 4K, 128 heads, one split (128 programs) and no merge pass, where two programs a
# multiprocessor's count would give two splits and their float32 partials.
_WGMMA_CONFIG = DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, wgmma=True, programs_per_sm=1)
# One query of up to 16 heads a sequence over an FP8 cache takes the keys-as-rows kernel on Hopper
# (`gluon.mla_decode_narrow`): B64 x 32K at 16 heads on an H200, 0.60 ms against the `tl.dot` kernel's 1.09 (a
# plain cache keeps the chunked kernel, 0.57 ms); 0.55 ms since it widens into float16. Two programs a
# multiprocessor (108 KiB of shared memory each): at B64, 4 splits (256 programs for 264 places) 0.59 ms,
# 8 splits 0.60; 3 splits (192) or 6 (384) 0.81 (bench/notes/fp8.md).
_NARROW_CONFIG = DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=1, narrow=True, programs_per_sm=2)
# Below this many keys in all (sequences x the block table's capacity) the `tl.dot` kernel's shorter splits
# win: with W_UV on an H200, B1 x 1K 10.1 us against 12.8-13.4, B4 x 1K 13.6 against 15.1-15.3, B1 x 4K 14.4
# against 14.8-14.9; from B4 x 4K (22.2 against 18.5) it loses (bench/notes/fp8.md).
_NARROW_MIN_TABLE_KEYS = 8192
# The interpreter's cost is per program and per step, not per element.
_INTERPRETER_CONFIG = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)

# About two split programs fit on a multiprocessor at once. Splits fill that one
# wave and no more: a partial second wave runs at a fraction of the bandwidth
# (B=128, 16 heads, 4K on an H100: 2 splits 0.23 ms, 3 splits 0.28 ms, 4 splits
# 0.24 ms). No split covers fewer than a config's `min_keys` keys of the table's
# capacity (128 unless it says otherwise), below which the partial-result traffic
# outweighs the gain (B=1, 4K context, 16 heads: 17 splits 21 us, 32 splits 13 us;
# B=8: 29 us and 28 us).
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 64


def decode_config(num_heads: int, device: torch.device, fp8: bool = False) -> DecodeConfig:
    """The split kernel's tiles for `num_heads` rows a sequence on `device`, over an FP8 latent cache if `fp8`
    (whole rows: the tiles every path can take, `mla_decode_num_splits`' and the batch-invariant decode's)."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    return (_GPU_FP8_CONFIGS if fp8 else _GPU_CONFIGS)[min(64, max(16, next_pow2(num_heads)))]


def launch_config(num_heads: int, q_len: int, kv_lora_rank: int, rope_dim: int, device: torch.device, fp8: bool,
                  dtype: torch.dtype, *, wgmma: bool = True, table_keys: int | None = None) -> DecodeConfig:
    """`mla_decode`'s tiles, from static shapes and the device:

    * the warpgroup-MMA kernel's (`_WGMMA_CONFIG`) where it applies on Hopper (`gluon.mla_decode.applies`);
    * over an FP8 cache, one query of at most 16 heads: the keys-as-rows kernel's (`_NARROW_CONFIG`,
      `gluon.mla_decode_narrow.applies`), unless `table_keys` (the batch's sequences times its block table's
      capacity; None: no bound) is below `_NARROW_MIN_TABLE_KEYS`;
    * else the chunked kernel's where it was measured faster (one query a row in 16 bits over a plain cache
      whose C is a power of two; float32 tiles of its three stages do not fit shared memory);
    * else `decode_config`'s.

    `wgmma` False keeps the `tl.dot` kernels (the Gluon kernels' twins, which tests and benchmarks set beside
    them). The two `tl.dot` kernels take the same heads a program, so the same split count; the Gluon kernels
    fill one wave of one program a multiprocessor, and so may take fewer (a caller's workspace sets the count
    either way: `workspace_splits`)."""
    key = min(64, max(16, next_pow2(num_heads)))
    if wgmma and gluon_decode.applies(num_heads, q_len, kv_lora_rank, rope_dim, dtype, device):
        return _WGMMA_CONFIG
    if (wgmma and gluon_narrow.applies(num_heads, q_len, kv_lora_rank, rope_dim, dtype, fp8, device)
            and (table_keys is None or table_keys >= _NARROW_MIN_TABLE_KEYS)):
        return _NARROW_CONFIG
    chunkable = (q_len == 1 and not fp8 and dtype != torch.float32 and kv_lora_rank >= 64
                 and next_pow2(kv_lora_rank) == kv_lora_rank)
    if device.type == "cuda" and chunkable and key in _GPU_CHUNKED_CONFIGS:
        return _GPU_CHUNKED_CONFIGS[key]
    return decode_config(num_heads * q_len, device, fp8)


# Up to this many sequences stage 2 also applies W_UV. Each of its programs
# re-reads a [BLOCK_V, C] slice of one head's W_UV, which at batch 1 is the
# cheapest way to read it (no extra launch, the slice loaded before the wait for
# stage 1); with many sequences the batched GEMM reads it once instead.
_FUSED_VALUE_MAX_SEQS = 8


def _tiling(num_heads: int, q_len: int, config: DecodeConfig) -> tuple[int, int]:
    """(rows of a split program, heads of a program): with several queries a row is a (head, query) pair."""
    if q_len == 1:
        return config.block_h, config.block_h
    rows = max(config.block_h, next_pow2(q_len))
    return rows, min(num_heads, rows // q_len)


def mla_decode_num_splits(
    num_seqs: int,
    num_heads: int,
    block_table_width: int,
    block_size: int,
    device: torch.device | str,
    config: DecodeConfig | None = None,
    *,
    q_len: int = 1,
) -> int:
    """Splits per sequence: depends only on static shapes and the device's multiprocessor count."""
    device = torch.device(device)
    config = config or decode_config(num_heads * q_len, device)
    if config.wgmma:
        programs = max(1, num_seqs) * gluon_decode.row_groups(num_heads, q_len)
    elif config.narrow:
        programs = max(1, num_seqs)
    else:
        _, heads_per_program = _tiling(num_heads, q_len, config)
        programs = max(1, num_seqs) * triton.cdiv(num_heads, heads_per_program)
    return fill_splits(programs, block_table_width * block_size, device, min_keys=config.min_keys,
                       max_splits=_MAX_SPLITS, programs_per_sm=config.programs_per_sm)


def fill_splits(programs: int, keys: int, device: torch.device, *, min_keys: int, max_splits: int,
                interpreter_min_keys: int | None = None, programs_per_sm: int = _PROGRAMS_PER_SM) -> int:
    """Splits of `keys` keys for `programs` programs a split: enough to fill one wave of about
    `programs_per_sm` programs a multiprocessor, none shorter than `min_keys` (on the CPU
    interpreter `interpreter_min_keys`, when given), at most `max_splits`. Static shapes only."""
    wanted = (programs_per_sm * sm_count(device)) // max(1, programs)
    shortest = min_keys if device.type == "cuda" or interpreter_min_keys is None else interpreter_min_keys
    return max(1, min(wanted, triton.cdiv(max(1, keys), shortest), max_splits))


def mla_decode_workspace(
    num_seqs: int,
    num_heads: int,
    kv_lora_rank: int,
    block_table_width: int,
    block_size: int,
    device: torch.device | str,
    *,
    q_len: int = 1,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials for `mla_decode(..., workspace=...)`, to allocate once per static shape.

    config: the tiles `mla_decode` will take (`launch_config` when it is given none); None: `decode_config`'s
    returns (partial_out [B * q_len, H, S, C] float32, partial_lse [B * q_len, H, S] float32),
    S = mla_decode_num_splits(B, H, W, bs, device, config, q_len=q_len).
    """
    splits = mla_decode_num_splits(num_seqs, num_heads, block_table_width, block_size, device, config,
                                   q_len=q_len)
    rows = num_seqs * q_len
    return (
        torch.empty((rows, num_heads, splits, kv_lora_rank), dtype=torch.float32, device=device),
        torch.empty((rows, num_heads, splits), dtype=torch.float32, device=device),
    )


# The split count follows the batch size, and eager (mixed) steps meet every batch
# size: as a constexpr or a specialised int it would compile a kernel per count mid-run.
@triton.jit(do_not_specialize=["num_splits", "s_plh"])
def _split_kernel(
    q_ptr, v_ptr, sc_ptr, r_ptr, bt_ptr, seq_lens_ptr, po_ptr, pl_ptr,
    num_heads, num_splits, scale_log2, s_sl,
    s_qb, s_qh, s_qd,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_btb, s_btw,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr,
    Q_LEN: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
    FP8: tl.constexpr, LENGTH_SPLITS: tl.constexpr = 0, MIN_SPLIT_KEYS: tl.constexpr = 128,
):
    # With Q_LEN > 1 the BLOCK_H rows of a program are (head, query) pairs, head
    # major: HEADS_PER_PROGRAM heads times the Q_LEN causal queries of sequence b,
    # which share every key tile. Q_LEN == 1 keeps rows = heads.
    b = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()

    seq_len = tl.load(seq_lens_ptr + b * s_sl)
    if LENGTH_SPLITS > 0:
        # Batch-invariant splits: their size is a function of the row's own length
        # (the smallest power of two from MIN_SPLIT_KEYS giving at most LENGTH_SPLITS
        # splits), so split boundaries sit at the same absolute positions whatever
        # the batch, the grid or the step kind.
        keys_per_split = tl.full([], MIN_SPLIT_KEYS, tl.int32)
        while keys_per_split * LENGTH_SPLITS < seq_len:
            keys_per_split *= 2
    else:
        # Whole key tiles per split, so only a split's last tile is ragged.
        keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)

    if Q_LEN == 1:
        heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < num_heads
    else:
        pair = tl.arange(0, BLOCK_H)
        query = pair % Q_LEN
        heads = head_group * HEADS_PER_PROGRAM + pair // Q_LEN
        head_mask = (pair < HEADS_PER_PROGRAM * Q_LEN) & (heads < num_heads)
        rows = b.to(tl.int64) * Q_LEN + query
        # Query j stands at position seq_len - Q_LEN + j and sees the keys up to it.
        key_end = seq_len - (Q_LEN - 1 - query)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)

    if Q_LEN == 1:
        q_row = q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh
    else:
        q_row = q_ptr + rows[:, None] * s_qb + heads[:, None] * s_qh
    q_nope = tl.load(q_row + offs_c[None, :] * s_qd,
                     mask=head_mask[:, None] & (offs_c[None, :] < KV_LORA_RANK), other=0.0)
    q_pe = tl.load(q_row + (KV_LORA_RANK + offs_r[None, :]) * s_qd,
                   mask=head_mask[:, None] & (offs_r[None, :] < ROPE_DIM), other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    # With one query, every iteration holds at least one visible key (start < end),
    # so m_i is finite after the first and exp2(m_i - m_new) never sees -inf - -inf.
    # With several, an early query may see none of a tile (or of a whole split),
    # so its shift falls back to 0 while its maximum is still -inf.
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        key_mask = pos < end
        page = tl.load(bt_row + (pos // PAGE_SIZE) * s_btw, mask=key_mask, other=0).to(tl.int64)
        k_latent, k_pe = latent_tile(v_ptr, sc_ptr, r_ptr, page, pos % PAGE_SIZE, key_mask,
                                     s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
                                     KV_LORA_RANK, ROPE_DIM, BLOCK_C, BLOCK_R, FP8)

        scores = tl.dot(q_nope, tl.trans(k_latent), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION)
        if Q_LEN == 1:
            scores = tl.where(key_mask[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
        else:
            visible = key_mask[None, :] & (pos[None, :] < key_end[:, None])
            scores = tl.where(visible, scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - shift)
            p = tl.exp2(scores - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_latent.dtype), k_latent, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))
    if Q_LEN == 1:
        po_row = po_ptr + b.to(tl.int64) * s_pob + heads[:, None] * s_poh + split * s_pos
    else:
        po_row = po_ptr + rows[:, None] * s_pob + heads[:, None] * s_poh + split * s_pos
    tl.store(po_row + offs_c[None, :] * s_pod, out.to(po_ptr.dtype.element_ty),
             mask=head_mask[:, None] & (offs_c[None, :] < KV_LORA_RANK))
    if Q_LEN == 1:
        tl.store(pl_ptr + b.to(tl.int64) * s_plb + heads * s_plh + split * s_pls, lse, mask=head_mask)
    else:
        tl.store(pl_ptr + rows * s_plb + heads * s_plh + split * s_pls, lse, mask=head_mask)


# The split count follows the batch size (see `_split_kernel`).
@triton.jit(do_not_specialize=["num_splits", "s_plh"])
def _chunked_split_kernel(
    q_ptr, v_ptr, sc_ptr, r_ptr, bt_ptr, seq_lens_ptr, po_ptr, pl_ptr,
    num_heads, num_splits, scale_log2, s_sl,
    s_qb, s_qh, s_qd,
    s_vn, s_vb, s_vd, s_scn, s_scb, s_scd, s_rn, s_rb, s_rd,
    s_btb, s_btw,
    s_pob, s_poh, s_pos, s_pod,
    s_plb, s_plh, s_pls,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GDC: tl.constexpr, FP8: tl.constexpr,
):
    # `_split_kernel` for one query a row, the latent's columns in four chunks (`latent_chunks.attend_tile`).
    b = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    seq_len = tl.load(seq_lens_ptr + b * s_sl)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)

    heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_n = tl.arange(0, BLOCK_N)
    b64 = b.to(tl.int64)
    q_row = q_ptr + b64 * s_qb + heads[:, None] * s_qh
    q0, q1, q2, q3, q_pe = chunked_queries(q_row, head_mask, s_qd, KV_LORA_RANK, ROPE_DIM, CHUNK, BLOCK_R, 4)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    a0 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
    bt_row = bt_ptr + b64 * s_btb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        key_mask = pos < end
        page = tl.load(bt_row + (pos // PAGE_SIZE) * s_btw, mask=key_mask, other=0).to(tl.int64)
        offset = pos % PAGE_SIZE
        m_i, l_i, a0, a1, a2, a3 = attend_tile(
            q0, q1, q2, q3, q_pe, v_ptr + page * s_vn + offset * s_vb, sc_ptr + page * s_scn + offset * s_scb,
            r_ptr + page * s_rn + offset * s_rb, key_mask, m_i, l_i, a0, a1, a2, a3, scale_log2,
            s_vd, s_scd, s_rd, KV_LORA_RANK, ROPE_DIM, CHUNK, BLOCK_R, 4, DOT_PRECISION, FP8)

    store_split(po_ptr + b64 * s_pob + heads[:, None] * s_poh + split * s_pos,
                pl_ptr + b64 * s_plb + heads * s_plh + split * s_pls, m_i, l_i, a0, a1, a2, a3, head_mask, s_pod,
                KV_LORA_RANK, CHUNK, 4)


def check_latent_attention_args(q: torch.Tensor, kv_cache: LatentCache, block_table: torch.Tensor,
                                kv_lora_rank: int, w_uv: torch.Tensor | BlockFP8Weight | None, *, num_seqs: int,
                                seq_lens: torch.Tensor | None = None, **per_row: torch.Tensor) -> LatentParts:
    """The argument checks every absorbed attention over the paged latent cache shares; returns the
    cache's leaves as the kernels take them (`latent_parts`).

    q [rows, H, C + R] float; kv_cache [num_blocks, bs, C + R] in q's dtype (or an `FP8LatentCache`
    whose RoPE values are); block_table [num_seqs, W] int32; seq_lens [num_seqs] int32 if given;
    per_row: more int32 tensors of num_seqs rows (e.g. indices); w_uv [H, Dv, C] in q's dtype, a
    stacked FP8 pair of that shape, or None; 0 < kv_lora_rank < C + R.
    """
    dim = q.shape[2]
    check_shape("kv_cache", kv_cache, (None, None, dim))
    check_shape("block_table", block_table, (num_seqs, None))
    check_float("q", q)
    if not 0 < kv_lora_rank < dim:
        raise ValueError(f"kv_lora_rank: expected in (0, {dim}), got {kv_lora_rank}")
    parts = latent_parts(kv_cache, kv_lora_rank)
    check_latent_cache(parts, q.dtype)
    check_dtype("block_table", block_table, (torch.int32,))
    tensors = dict(per_row) if seq_lens is None else {"seq_lens": seq_lens, **per_row}
    for name, t in tensors.items():
        check_shape(name, t, (num_seqs,) + (None,) * (t.dim() - 1))
        check_dtype(name, t, (torch.int32,))
    check_same_device(q=q, kv_cache=parts.rope, block_table=block_table, **tensors)
    if w_uv is not None:
        check_head_weight("w_uv", w_uv, q, (q.shape[1], None, kv_lora_rank))
    return parts


def workspace_splits(workspace: tuple[torch.Tensor, torch.Tensor] | None) -> int | None:
    """The split count a caller's workspace (partial_out [rows, H, S, C], partial_lse) was made for, so that
    a workspace from `*_workspace` fits whichever kernel the launch config takes; None without one (or with
    one of the wrong rank, which `split_partials` refuses by name)."""
    if workspace is None or workspace[0].dim() != 4:
        return None
    return int(workspace[0].shape[2])


def check_gluon_takes(q: torch.Tensor, parts: LatentParts, q_len: int, config: DecodeConfig) -> None:
    """Refuses, naming what does not fit, a decode a config sends to a Gluon kernel that cannot take it: the
    warpgroup-MMA kernel (`config.wgmma`: `gluon.mla_decode.applies`) or the keys-as-rows one (`config.narrow`:
    `gluon.mla_decode_narrow.applies`), both needing rows `cp.async` can gather (`copyable`). q [rows, H, C + R];
    parts: the cache's leaves."""
    num_heads, dim = q.shape[1], q.shape[2]
    kv_lora_rank = parts.values.shape[2]
    rope_dim = dim - kv_lora_rank
    if config.wgmma:
        name, takes = "warpgroup-MMA", gluon_decode.applies(num_heads, q_len, kv_lora_rank, rope_dim, q.dtype, q.device)
        rows = f"bf16/fp16 queries, at least {gluon_decode.BLOCK_M} rows (heads x queries) a sequence, over a cache"
    else:
        name, takes = "keys-as-rows", gluon_narrow.applies(num_heads, q_len, kv_lora_rank, rope_dim, q.dtype,
                                                           parts.fp8, q.device)
        rows = f"one bf16/fp16 query of at most {gluon_narrow.BLOCK_H} heads a sequence, over an FP8 cache"
    if not (takes and gluon_decode.copyable(parts.values, parts.rope)):
        raise ValueError(f"config: the {name} kernel takes {rows} with kv_lora_rank="
                         f"{gluon_decode.KV_LORA_RANK}, rope {gluon_decode.ROPE_DIM} and rows of 16-byte aligned "
                         f"contiguous columns on a Hopper GPU, got {q.dtype}, {num_heads} heads x q_len={q_len}, "
                         f"{'an FP8' if parts.fp8 else 'a plain'} cache, "
                         f"kv_lora_rank={kv_lora_rank}, rope {rope_dim}, cache strides {tuple(parts.values.stride())} "
                         f"on {q.device}")


def mla_decode(
    q: torch.Tensor,
    kv_cache: LatentCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    w_uv: torch.Tensor | BlockFP8Weight | None = None,
    q_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: `q_len` query tokens per sequence attend causally over its latent cache.

    The contract of `reference.attention.mla_decode`: query j of sequence b stands
    at position seq_lens[b] - q_len + j and sees keys [0, seq_lens[b] - q_len + j].

    q:           [B * q_len, H, C + R] absorbed query (any strides), bf16 / fp16 / fp32;
                 the rows of sequence b are b * q_len .. b * q_len + q_len - 1
    kv_cache:    [num_blocks, bs, C + R], same dtype as q, or an `FP8LatentCache` whose RoPE
                 values have q's dtype (read dequantized)
    block_table: [B, W] int32
    seq_lens:    [B] int32 KV length after this step (>= q_len); 0 marks a padded sequence
    workspace:   (partial_out [B * q_len, H, S, C] fp32, partial_lse [B * q_len, H, S] fp32)
                 from `mla_decode_workspace`, so that a captured graph allocates only its
                 outputs; None allocates it here. Its S is the split count (any S >= 1 gives
                 the same answer; the kernel a config takes may prefer another). Unused when S == 1.
    num_splits:  overrides `mla_decode_num_splits` (tests); must match the workspace.
    config:      overrides the tile sizes (benchmark sweeps); `chunks=4` takes the chunked kernel.
    w_uv:        [H, Dv, C] value up-projection in q's dtype (any strides), a stacked FP8 pair
                 (read dequantized into q's dtype), or None
    returns      out [B * q_len, H, C] in q's dtype, or with w_uv out [B * q_len, H, Dv] =
                 (out rounded to q's dtype) @ w_uv[h]^T; lse [B * q_len, H] float32 (natural
                 log); the rows of a padded sequence give out 0, lse -inf.
    """
    if q_len < 1:
        raise ValueError(f"q_len: expected at least 1, got {q_len}")
    num_rows, num_heads, dim = q.shape
    if num_rows % q_len:
        raise ValueError(f"q: expected a multiple of q_len={q_len} rows, got {num_rows}")
    num_seqs = num_rows // q_len
    rope_dim = dim - kv_lora_rank
    _, block_size, _ = kv_cache.shape
    parts = check_latent_attention_args(q, kv_cache, block_table, kv_lora_rank, w_uv, num_seqs=num_seqs,
                                        seq_lens=seq_lens)
    fused_value = w_uv is not None and num_rows <= _FUSED_VALUE_MAX_SEQS
    width = block_table.shape[1]
    device = q.device
    config = config or launch_config(num_heads, q_len, kv_lora_rank, rope_dim, device, parts.fp8, q.dtype,
                                     wgmma=gluon_decode.copyable(parts.values, parts.rope),
                                     table_keys=num_seqs * width * block_size)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
    splits = num_splits or workspace_splits(workspace) or mla_decode_num_splits(
        num_seqs, num_heads, width, block_size, device, config, q_len=q_len)
    block_rows, heads_per_program = _tiling(num_heads, q_len, config)

    out = torch.empty((num_rows, num_heads, kv_lora_rank), dtype=q.dtype, device=device)
    lse = torch.empty((num_rows, num_heads), dtype=torch.float32, device=device)
    if num_seqs == 0:
        return (out if w_uv is None else project_values(out, w_uv)), lse
    # One split is already the whole answer: stage 1 writes the outputs and stage 2 is skipped.
    partial_out, partial_lse = split_partials(out, lse, splits, direct=splits == 1 and not fused_value,
                                              workspace=workspace)

    grid = (num_seqs, triton.cdiv(num_heads, heads_per_program), splits)
    use_pdl = pdl(device)
    if config.wgmma:
        check_gluon_takes(q, parts, q_len, config)
        gluon_decode.wgmma_split_decode(q, parts.values, parts.rope, block_table, seq_lens, partial_out,
                                        partial_lse, softmax_scale_log2=softmax_scale * LOG2E, q_len=q_len,
                                        scales=parts.scales if parts.fp8 else None)
    elif config.narrow:
        check_gluon_takes(q, parts, q_len, config)
        gluon_narrow.narrow_split_decode(q, parts.values, parts.scales, parts.rope, block_table, seq_lens, partial_out,
                                         partial_lse, softmax_scale_log2=softmax_scale * LOG2E)
    elif config.chunks == 4:
        if q_len != 1 or kv_lora_rank < 64 or next_pow2(kv_lora_rank) != kv_lora_rank:
            raise ValueError(f"config: four chunks take one query a row and a power-of-two kv_lora_rank of at least "
                             f"64, got q_len={q_len}, kv_lora_rank={kv_lora_rank}")
        _chunked_split_kernel[grid](
            q, *parts.pointers(), block_table, seq_lens, partial_out, partial_lse,
            num_heads, splits, softmax_scale * LOG2E, seq_lens.stride(0),
            *q.stride(), *parts.strides(), *block_table.stride(),
            *partial_out.stride(), *partial_lse.stride(),
            KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, CHUNK=kv_lora_rank // 4,
            BLOCK_R=max(16, next_pow2(rope_dim)), BLOCK_H=config.block_h, BLOCK_N=config.block_n,
            PAGE_SIZE=block_size, DOT_PRECISION=dot_precision(q.dtype), GDC=use_pdl, FP8=parts.fp8,
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
        )
    else:
        _split_kernel[grid](
            q, *parts.pointers(), block_table, seq_lens, partial_out, partial_lse,
            num_heads, splits, softmax_scale * LOG2E, seq_lens.stride(0),
            *q.stride(), *parts.strides(), *block_table.stride(),
            *partial_out.stride(), *partial_lse.stride(),
            KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, FP8=parts.fp8,
            BLOCK_C=next_pow2(kv_lora_rank), BLOCK_R=max(16, next_pow2(rope_dim)),
            BLOCK_H=block_rows, BLOCK_N=config.block_n,
            PAGE_SIZE=block_size,
            DOT_PRECISION=dot_precision(q.dtype), GDC=use_pdl,
            Q_LEN=q_len, HEADS_PER_PROGRAM=heads_per_program,
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


def decode_flops(num_heads: int, total_keys: int, kv_lora_rank: int, rope_dim: int) -> int:
    """Multiply-adds x 2 of scores (C + R) and of the value product (C) over all keys."""
    return 2 * num_heads * total_keys * (2 * kv_lora_rank + rope_dim)

