"""Batch-invariant reference ops of DeepSeek-V4: each row's bits depend on that row's inputs only.

Every op here runs on row tiles of `V4_ROW_TILE` rows (`row_tiles`): each torch call then
has one shape whatever the batch, so a BLAS product takes one code path and an elementwise
exp, sigmoid or log one loop (torch's CPU kernels take a tensor's last few elements
through a scalar loop that rounds otherwise than the vector one). What else changes
against the reference table, and why:

* `window_entry_attention`: the reference attends to every entry the row's table
  could hold (HCA) or every slot of the indexer's list (CSA) in one softmax, and
  that length follows the batch (the widest table, or top-k cut to the candidates
  the widest table holds). Here the window is one chunk of `sliding_window` keys
  (a length set by the model), the entry list is cut into `ENTRY_SPLIT`-entry
  chunks from its start, and the chunks, then the sink, fold into one running
  softmax in that order: chunks past a row's entries add exact zeros.
* `hc_site`, `hc_write_back`, `hc_write_back_site`, `hc_head`, `clamped_experts`: the
  reference ops themselves, on row tiles (their products and gates had the batch's shape).
* `compress_entries`: the rows that complete an entry (as many as the batch has) pooled
  on row tiles.
* `index_scores` (the `dsa` group's: V4's CSA indexer and V3.2's): the reference over
  tiles of `KEY_TILE` keys of the table, so a key's dot products and head sum have one
  shape whatever the table's width (there is no exponential to tile rows for).

Kept, as row-local with exact arithmetic (products, sums over the model's
dimensions, square roots): `rope_tail`, `unit_rms`, `top_k_indices` (an exact
selection with a fixed tie rule) and `write_index_key` (a copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index_cache import IndexCache
from ..latent_cache import EntryCacheT, LatentCache
from ..quantized import Weight, dequantized
from . import dsa as ref_dsa
from . import v4_hc as ref_hc
from .attention import _acc_dtype
from .row_tiles import by_row_tiles
from .v4_moe import clamped_experts as reference_clamped_experts
from .v4_paged import _pool, _rows_of, _slots, completing_rows, write_entry_rows

# Rows a tile of every op here holds. torch's CPU elementwise kernels run the last (size mod twice the
# vector width) elements of a tensor through a scalar loop whose exp, sigmoid and log round otherwise
# than the vector loop's: in tiles of 64 rows an op's element count is a multiple of 64 (two AVX-512
# vectors of bfloat16, four of float32), so no row's elements fall in that tail, wherever it sits
# (`row_tiles.ROW_TILE`'s 16 rows leave a tail for N = 3 streams' gates: 48 of a 32-element step).
V4_ROW_TILE = 64
# Entries a chunk of the entries scope holds.
ENTRY_SPLIT = 64
# Keys a tile of the indexer's scores holds (whole blocks of the indexer's cache).
KEY_TILE = 64


@dataclass(frozen=True, slots=True)
class _Partial:
    """One row's scopes folded so far, in the accumulation dtype: m [n, H] the largest logit (-inf before
    any), total [n, H] the sum of exp(logit - m), out [n, H, D] the sum of exp(logit - m) * value."""

    m: torch.Tensor
    total: torch.Tensor
    out: torch.Tensor


def _empty(q: torch.Tensor) -> _Partial:
    n, h, d = q.shape
    return _Partial(torch.full((n, h), float("-inf"), dtype=q.dtype, device=q.device),
                    torch.zeros((n, h), dtype=q.dtype, device=q.device),
                    torch.zeros((n, h, d), dtype=q.dtype, device=q.device))


def _rescale(p: _Partial, chunk_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the new maximum, its finite stand-in, the factor the sums so far take)."""
    m = torch.maximum(p.m, chunk_max)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, shift, torch.exp(p.m - shift)


def _fold(p: _Partial, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, softmax_scale: float) -> _Partial:
    """One chunk of each row's keys (values are the keys): q [n, H, D] and keys [n, L, D] in the
    accumulation dtype, valid [n, L] bool. A chunk without a valid key leaves the bits as they were:
    its maximum is -inf, so the sums are rescaled by exp(0) = 1 and add zeros."""
    # Masked keys may be anything a padded row left in the scratch block: 0 * inf must not reach a row.
    keys = keys.masked_fill(~valid.unsqueeze(-1), 0)
    scores = torch.bmm(q, keys.transpose(1, 2)) * softmax_scale                              # nhd,nld->nhl
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m, shift, rescale = _rescale(p, scores.amax(dim=-1))
    probs = torch.exp(scores - shift.unsqueeze(-1))
    return _Partial(m, p.total * rescale + probs.sum(dim=-1),
                    p.out * rescale.unsqueeze(-1) + torch.bmm(probs, keys))                    # nhl,nld->nhd


def _fold_sink(p: _Partial, sinks: torch.Tensor) -> _Partial:
    """The per-head sink sinks [H]: one more logit, with a zero value."""
    sink = sinks.to(p.m.dtype).expand_as(p.m)
    m, shift, rescale = _rescale(p, sink)
    return _Partial(m, p.total * rescale + torch.exp(sink - shift), p.out * rescale.unsqueeze(-1))


def _result(p: _Partial, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [n, H, D] in `dtype`, lse [n, H] float32); a row without a logit: out 0, lse -inf."""
    has = p.total > 0
    total = torch.where(has, p.total, torch.ones_like(p.total))
    lse = torch.where(has, p.m + torch.log(total), torch.full_like(total, float("-inf")))
    return (p.out / total.unsqueeze(-1)).to(dtype), lse.float()


def window_entry_attention(q: torch.Tensor, window_cache: LatentCache, block_table: torch.Tensor,
                           key_lens: torch.Tensor, sinks: torch.Tensor, *, softmax_scale: float, sliding_window: int,
                           entry_cache: LatentCache | None = None, entry_table: torch.Tensor | None = None,
                           entry_indices: torch.Tensor | None = None, compress_rate: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.v4_paged.window_entry_attention`, batch-invariant: the window, then the entry
    list in ENTRY_SPLIT-entry chunks, then the sink, folded in that order, on row tiles.

    q [n, H, D]; window_cache [nb, bs, D] through block_table [n, W]; key_lens [n] int32; sinks [H];
    entry_cache [nbg, bsg, D] through entry_table [n, Wg] (None: no entries); entry_indices [n, k]
    int32 (-1: none) or None (every complete entry) -> out [n, H, D] in q's dtype, lse [n, H] float32.
    """
    if entry_cache is not None and (entry_table is None or compress_rate < 1):
        raise ValueError(f"window_entry_attention: entries need entry_table and compress_rate >= 1, got "
                         f"entry_table={'None' if entry_table is None else tuple(entry_table.shape)}, "
                         f"compress_rate={compress_rate}")

    def tile(qt: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, *entry_rows: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return _tile_attention(qt, window_cache, table, lens, sinks, softmax_scale=softmax_scale,
                               sliding_window=sliding_window, entry_cache=entry_cache, compress_rate=compress_rate,
                               entry_table=entry_rows[0] if entry_rows else None,
                               entry_indices=entry_rows[1] if len(entry_rows) > 1 else None)

    # Padded rows of the last tile have key_lens 0: they see no key (and entry 0 of table row 0, masked).
    entry_rows = () if entry_cache is None or entry_table is None else (
        (entry_table,) if entry_indices is None else (entry_table, entry_indices))
    out, lse = by_row_tiles(tile, q, block_table, key_lens, *entry_rows, tile=V4_ROW_TILE)
    return out, lse


def _tile_attention(q: torch.Tensor, window_cache: LatentCache, block_table: torch.Tensor, key_lens: torch.Tensor,
                    sinks: torch.Tensor, *, softmax_scale: float, sliding_window: int,
                    entry_cache: LatentCache | None, entry_table: torch.Tensor | None,
                    entry_indices: torch.Tensor | None, compress_rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_entry_attention` of one row tile (every tensor op of fixed shape, so elementwise
    exponentials and logarithms take the same vector or scalar path for a row whatever the batch)."""
    n = q.shape[0]
    device = q.device
    acc = _acc_dtype(q.dtype)
    qa = q.to(acc)
    offsets = torch.arange(sliding_window, device=device, dtype=torch.int64) - sliding_window
    positions = key_lens.to(torch.int64).unsqueeze(1) + offsets                             # [n, window]
    keys = _rows_of(window_cache, _slots(block_table, positions.clamp(min=0), window_cache.shape[1]))
    partial = _fold(_empty(qa), qa, keys.to(acc), positions >= 0, softmax_scale)
    if entry_cache is not None and entry_table is not None:
        capacity = entry_table.shape[1] * entry_cache.shape[1]
        counts = (key_lens.to(torch.int64) // compress_rate).unsqueeze(1)                   # [n, 1]
        listed = capacity if entry_indices is None else entry_indices.shape[1]
        for start in range(0, listed, ENTRY_SPLIT):
            slot = start + torch.arange(ENTRY_SPLIT, device=device)                        # [S] list slots
            if entry_indices is None:
                chosen = slot.expand(n, -1)
            else:
                chosen = entry_indices.to(torch.int64)[:, slot.clamp(max=listed - 1)]
                chosen = torch.where(slot < listed, chosen, -1)
            valid = (chosen >= 0) & (chosen < counts) & (chosen < capacity)
            entry_slots = _slots(entry_table, chosen.clamp(0, capacity - 1), entry_cache.shape[1])
            partial = _fold(partial, qa, _rows_of(entry_cache, entry_slots).to(acc), valid, softmax_scale)
    return _result(_fold_sink(partial, sinks), q.dtype)


def hc_site(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            norm_weight: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.v4_hc.hc_site` on row tiles: streams [T, N, D] -> (x [T, D], post [T, N], comb [T, N, N])."""
    def tile(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ref_hc.hc_site(s, fn, base, scale, norm_weight, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)

    x, post, comb = by_row_tiles(tile, streams, tile=V4_ROW_TILE)
    return x, post, comb


def hc_write_back(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """`reference.v4_hc.hc_write_back` on row tiles: post [T, N], comb [T, N, N]; out [T, D];
    streams [T, N, D] -> new streams [T, N, D]."""
    return by_row_tiles(ref_hc.hc_write_back, post, comb, out, streams, tile=V4_ROW_TILE)[0]


def hc_write_back_site(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor,
                       fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *,
                       iters: int, hc_eps: float, norm_eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.v4_hc.hc_write_back_site` on row tiles -> (new streams [T, N, D], x [T, D], post [T, N],
    comb [T, N, N])."""
    def tile(p: torch.Tensor, c: torch.Tensor, o: torch.Tensor, s: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return ref_hc.hc_write_back_site(p, c, o, s, fn, base, scale, norm_weight, iters=iters, hc_eps=hc_eps,
                                         norm_eps=norm_eps)

    new, x, post_out, comb_out = by_row_tiles(tile, post, comb, out, streams, tile=V4_ROW_TILE)
    return new, x, post_out, comb_out


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """`reference.v4_hc.hc_head` on row tiles: streams [T, N, D] -> [T, D]."""
    return by_row_tiles(lambda s: ref_hc.hc_head(s, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps), streams,
                        tile=V4_ROW_TILE)[0]


def clamped_experts(x: torch.Tensor, w13: Weight, w2: Weight, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    limit: float) -> torch.Tensor:
    """Contract of `reference.v4_moe.clamped_experts` on row tiles (padding rows take weight 0):
    x [T, D]; w13 [E, 2I, D]; w2 [E, D, I]; topk_weights, topk_ids [T, k] -> [T, D]."""
    # Dequantized once, not once a tile.
    w13, w2 = dequantized(w13, x.dtype), dequantized(w2, x.dtype)
    return by_row_tiles(lambda xt, wt, it: reference_clamped_experts(xt, w13, w2, wt, it, limit=limit),
                        x, topk_weights, topk_ids, tile=V4_ROW_TILE)[0]


def compress_entries(inputs: torch.Tensor, entries: EntryCacheT, group_slots: torch.Tensor, key_lens: torch.Tensor,
                     block_table: torch.Tensor, position_bias: torch.Tensor, kv_norm: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, *, rate: int, overlap: bool, eps: float, num_seqs: int,
                     inplace: bool) -> EntryCacheT:
    """Contract of `reference.v4_paged.compress_entries`, the completing rows pooled on row tiles
    (their number follows the batch): inputs [nb, bs, 2 * c * Dc]; entries [nbg, bsg, Dc];
    group_slots [n]; key_lens [n]; block_table [n, W] -> the entries cache."""
    rows = completing_rows(group_slots, rate, num_seqs)

    def tile(lens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        # Padded rows have key_lens 0: no slot of theirs is valid, and they are cut before the write.
        return _pool(inputs, lens, table, position_bias, kv_norm, cos, sin, rate=rate, overlap=overlap, eps=eps)

    pooled = by_row_tiles(tile, key_lens[rows], block_table[rows], tile=V4_ROW_TILE)[0]
    return write_entry_rows(entries, group_slots[rows], pooled, inplace=inplace)


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, index_cache: IndexCache, block_table: torch.Tensor,
                 key_lens: torch.Tensor, *, weight_scale: float = 1.0) -> torch.Tensor:
    """`reference.dsa.index_scores` over the table cut into tiles of KEY_TILE keys (one block at least).

    q [T, Hi, Di]; head_weights [T, Hi] float32; index_cache [num_blocks, bs, Di] (an `FP8IndexCache`
    read dequantized); block_table [T, W] int32; key_lens [T] int32 -> scores [T, W * bs] float32
    (float64 for float64 inputs).
    """
    width, block_size = block_table.shape[1], index_cache.shape[1]
    blocks = max(1, KEY_TILE // block_size)                                                   # a tile's blocks
    # The last tile reaches past the table into the scratch block: those columns are cut below.
    table = torch.cat([block_table, block_table.new_zeros((block_table.shape[0], -width % blocks))], dim=1)
    parts = [ref_dsa.index_scores(q, head_weights, index_cache, table[:, start:start + blocks],
                                  (key_lens - start * block_size).clamp(min=0), weight_scale=weight_scale)
             for start in range(0, width, blocks)]
    if not parts:
        return ref_dsa.index_scores(q, head_weights, index_cache, block_table, key_lens, weight_scale=weight_scale)
    return torch.cat(parts, dim=1)[:, :width * block_size]
