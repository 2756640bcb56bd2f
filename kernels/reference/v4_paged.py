"""DeepSeek-V4's attention and compressor ops over the paged caches, in plain torch.

The kernels' contracts: each query row reads its keys where the caches keep them
(its window through its group-0 block table, its compressed entries through the
compressed group's table), so no caller gathers keys first. These references
gather, then reuse the gathered-key building blocks of `v4_attention`
(`scope_attention`, `pool_entries`) and the one LSE merge.

Shapes: n rows (one query token each), H heads, D = head_dim, W / Wg block-table
widths of group 0 / the compressed group, bs / bsg their block sizes.

The key caches (window, entries) are `LatentCache`s: a tensor, or an `FP8LatentCache` read
dequantized (`latent_rows`: the D - R leading values times their group's scale, rounded once to
the activations' dtype, then the R rotated values); an entries cache of CSA's indexer keys may be
an `FP8IndexCache`. Each is written as its own type writes (`write_kv`, `write_index_key`).
"""

from __future__ import annotations

import torch

from ..index_cache import FP8IndexCache
from ..latent_cache import EntryCacheT, FP8LatentCache, LatentCache, latent_rows
from .attention import merge_attn_states
from .cache import write_kv
from .dsa import write_index_key
from .norm import rms_norm
from .v4_attention import pool_entries, rope_tail, scope_attention


def _slots(block_table: torch.Tensor, indices: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table [n, W] int32, indices [n, L] int64 (>= 0, within the table) -> cache slots [n, L] int64."""
    blocks = torch.gather(block_table.to(torch.int64), 1, indices // block_size)
    return blocks * block_size + indices % block_size


def _rows_of(cache: LatentCache, slots: torch.Tensor) -> torch.Tensor:
    """The rows at cache slots [...] int64 -> [..., D] in the activations' dtype (FP8 rows dequantized)."""
    block_size = cache.shape[1]
    return latent_rows(cache, slots // block_size, slots % block_size)


def write_entry_rows(entries: EntryCacheT, slots: torch.Tensor, rows: torch.Tensor, *, inplace: bool) -> EntryCacheT:
    """rows [n, Dc] written at entry slots [n] int64 (-1: none) of an entries cache of either kind: a
    key cache (a tensor or an `FP8LatentCache`, `write_kv`) or CSA's indexer keys as FP8 (`FP8IndexCache`,
    `write_index_key`) -> the cache of the type given."""
    if isinstance(entries, FP8IndexCache):
        return write_index_key(entries, slots, rows, inplace=inplace)
    if isinstance(entries, (torch.Tensor, FP8LatentCache)):
        return write_kv(entries, slots, rows, inplace=inplace)
    raise TypeError(f"entries: expected a tensor, an FP8LatentCache or an FP8IndexCache, got {type(entries).__name__}")


def window_entry_attention(q: torch.Tensor, window_cache: LatentCache, block_table: torch.Tensor,
                           key_lens: torch.Tensor, sinks: torch.Tensor, *, softmax_scale: float, sliding_window: int,
                           entry_cache: LatentCache | None = None, entry_table: torch.Tensor | None = None,
                           entry_indices: torch.Tensor | None = None, compress_rate: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 attention of each row over its window and its compressed entries, with the per-head sink.

    q:             [n, H, D] (rotated); values are the keys (K = V)
    window_cache:  [nb, bs, D] every token's key, paged by group 0 (a tensor or an `FP8LatentCache`)
    block_table:   [n, W] int32, the row's sequence's group-0 table
    key_lens:      [n] int32, the row's position + 1 (0: a padded row)
    sinks:         [H] one logit per head that carries no value
    sliding_window: the window scope is positions [key_lens - sliding_window, key_lens), >= 0
    entry_cache:   [nbg, bsg, D] compressed entries, as the window's (None: a sliding-window layer, no second
                   scope)
    entry_table:   [n, Wg] int32, the row's table in the entries' group
    entry_indices: [n, k] int32 entry numbers the row attends to (CSA's top-k, -1: none), or None for
                   every complete entry (HCA). Only entries complete at the row count: e < key_lens // compress_rate
    returns        (out [n, H, D] in q's dtype, lse [n, H] float32 of both scopes and the sink).
    An empty scope contributes nothing; a padded row (every scope empty) gets out 0, never NaN.
    """
    n = q.shape[0]
    block_size = window_cache.shape[1]
    offsets = torch.arange(sliding_window, device=q.device, dtype=torch.int64) - sliding_window
    positions = key_lens.to(torch.int64).unsqueeze(1) + offsets                          # [n, window]
    valid = positions >= 0
    keys = _rows_of(window_cache, _slots(block_table, positions.clamp(min=0), block_size))
    out, lse = scope_attention(q, keys, valid, softmax_scale=softmax_scale)
    if entry_cache is not None:
        if entry_table is None or compress_rate < 1:
            raise ValueError(f"window_entry_attention: entries need entry_table and compress_rate >= 1, got "
                             f"entry_table={'None' if entry_table is None else tuple(entry_table.shape)}, "
                             f"compress_rate={compress_rate}")
        capacity = entry_table.shape[1] * entry_cache.shape[1]
        counts = (key_lens.to(torch.int64) // compress_rate).unsqueeze(1)                 # [n, 1]
        if entry_indices is None:
            chosen = torch.arange(capacity, device=q.device).expand(n, -1)
        else:
            chosen = entry_indices.to(torch.int64)
        entry_valid = (chosen >= 0) & (chosen < counts) & (chosen < capacity)
        entry_keys = _rows_of(entry_cache, _slots(entry_table, chosen.clamp(0, capacity - 1), entry_cache.shape[1]))
        entry_out, entry_lse = scope_attention(q, entry_keys, entry_valid, softmax_scale=softmax_scale)
        out, lse = merge_attn_states(out, lse, entry_out, entry_lse)
    return merge_attn_states(out, lse, torch.zeros_like(out), sinks.float().expand(n, -1))


def completing_rows(group_slots: torch.Tensor, rate: int, num_seqs: int) -> torch.Tensor:
    """Row indices [n_max] (static size) listing first every row whose group slot is >= 0.

    A chunk of L tokens of one sequence completes at most L // rate + 1 entries, so
    n_max = min(n, n // rate + num_seqs) rows hold every completing row; the rest of
    the list are rows that complete nothing (their slot is -1: they write nothing).
    """
    n = group_slots.shape[0]
    n_max = min(n, n // rate + num_seqs)
    order = torch.argsort((group_slots < 0).to(torch.int8), stable=True)
    return order[:n_max]


def _pool(inputs: torch.Tensor, key_lens: torch.Tensor, block_table: torch.Tensor, position_bias: torch.Tensor,
          kv_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rate: int, overlap: bool,
          eps: float) -> torch.Tensor:
    """The entry each row completes: [n, Dc] in the inputs' dtype (see `compress_entries`)."""
    c = 2 if overlap else 1
    width = kv_norm.shape[0]
    entry = (key_lens.to(torch.int64) - 1).clamp(min=0) // rate                              # [n]
    offsets = torch.arange(c * rate, device=entry.device, dtype=torch.int64) - (c - 1) * rate
    positions = entry.unsqueeze(1) * rate + offsets                                         # [n, c * rate]
    # A row that completes no entry reads nothing past its own position (its result is not written).
    last = (key_lens.to(torch.int64) - 1).unsqueeze(1)
    valid = (positions >= 0) & (positions <= last)
    src = _rows_of(inputs, _slots(block_table, torch.minimum(positions, last).clamp(min=0), inputs.shape[1]))
    kv, gate = src.split([c * width, c * width], dim=-1)
    if overlap:
        # Slots [0, rate): series Ca of the previous block; [rate, 2 * rate): series Cb of this one.
        kv = torch.cat([kv[:, :rate, :width], kv[:, rate:, width:]], dim=1)
        gate = torch.cat([gate[:, :rate, :width] + position_bias[:, :width],
                          gate[:, rate:, width:] + position_bias[:, width:]], dim=1)
    else:
        gate = gate + position_bias
    pooled = rms_norm(pool_entries(kv, gate, valid), kv_norm, eps)
    start = entry * rate
    return rope_tail(pooled, cos[start], sin[start])


def compress_entries(inputs: torch.Tensor, entries: EntryCacheT, group_slots: torch.Tensor, key_lens: torch.Tensor,
                     block_table: torch.Tensor, position_bias: torch.Tensor, kv_norm: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, *, rate: int, overlap: bool, eps: float, num_seqs: int,
                     inplace: bool) -> EntryCacheT:
    """The compressor's update: every row that completes a block pools it into an entry and writes it.

    inputs:        [nb, bs, 2 * c * Dc] the compressor's kv | gate projections of every token (group 0),
                   this step's tokens already written (c = 2 with overlap, else 1)
    entries:       [nbg, bsg, Dc] the compressed cache: a tensor, an `FP8LatentCache` or an `FP8IndexCache`
                   (the entry quantized as that type's write does, `write_entry_rows`)
    group_slots:   [n] int64, the entry's slot for a row that completes one ((p + 1) % rate == 0), else -1
    key_lens:      [n] int32, the row's position + 1; block_table [n, W] int32 its group-0 table
    position_bias: [rate, c * Dc] float32; kv_norm [Dc]; cos, sin [P, R / 2] the compress rope tables
    num_seqs:      sequences the rows belong to (bounds how many rows complete an entry)
    Entry w = RMSNorm(sum_s softmax_s(gate_s + bias_s) * kv_s) over its block's slots (with overlap,
    series Ca of block w - 1 then series Cb of block w), its trailing R channels rotated at
    position w * rate. Returns the entries cache (the same tensor when `inplace`).
    """
    rows = completing_rows(group_slots, rate, num_seqs)
    pooled = _pool(inputs, key_lens[rows], block_table[rows], position_bias, kv_norm, cos, sin, rate=rate,
                   overlap=overlap, eps=eps)
    return write_entry_rows(entries, group_slots[rows], pooled, inplace=inplace)
