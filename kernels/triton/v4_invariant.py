"""Batch-invariant Triton ops of DeepSeek-V4: every launch configuration set by the model's shapes alone.

What changes against the default table, and why:

* `window_entry_attention`: one tile configuration (64 heads a program from 64 heads
  on, the dense decode's tiles below) and one split a row, the sink folded in by that
  split, for every row count. The default takes 16-head programs of 32-key tiles up to
  4 rows, and a split count chosen from the row count and the longest list the batch's
  tables can hold: a row's key tiles, and the order its partial sums meet, followed
  its batch. With one split a row's keys are folded tile after tile from the first
  window key on, so a row's bits depend on its own keys only.
* `hc_site`, `hc_write_back`, `hc_write_back_site`, `hc_head`: the streams pass always
  takes its tokens 16 at a time through its dot product (`_streams_dot_kernel`), with D
  cut into slices of `_SLICE_CHUNKS` chunks (a width set by D alone). The default takes
  a token at a time below 8 tokens (another arithmetic for the mixing dots) and as many
  slices as fill the GPU at that token count (other partial sums of a row).
* `index_scores` (V4's CSA indexer, and V3.2's): one tile configuration for every row
  count (the default picks one by the chunk length, which follows the row count).

The experts (`clamped_experts`) take the batch-invariant fused MoE's configuration,
beside it in `triton.invariant`. Kept, as row-local with tiles sized by the model's
dimensions: `rope_tail` and `unit_rms` (a program a row), `compress_entries` (a program
a completing row, its slots in fixed steps), `top_k_indices` (an exact selection: every
path of it gives the contract's bits) and `write_index_key` (a copy).
"""

from __future__ import annotations

import torch
import triton

from ..index_cache import IndexCache
from ..latent_cache import LatentCache
from .decode import DecodeConfig, decode_config
from .dsa_indexer import IndexerConfig, index_scores, indexer_config
from .v4_attention import _GPU_CONFIG_64_HEADS, window_entry_attention
from .v4_hc_site import (_BLOCK_D, _MAX_BLOCK_T, StreamsLayout, hc_head, hc_site, hc_write_back,
                         hc_write_back_site)

# Chunks of _BLOCK_D (64) columns a slice of D holds: V4's D = 4096 in 16 slices, so a handful of
# tokens still spreads fn's read over 16 programs a token block.
_SLICE_CHUNKS = 4
# The indexer's tiles: 64 keys a step (as every GPU configuration of the default), the pages of
# 16 tiles looked up at once; the warpgroup-MMA kernel where it applies (a row's tiles are the same
# products whatever rows share the launch).
_GPU_INDEXER = IndexerConfig(block_n=64, num_warps=4, num_stages=4, locate_tiles=16, wgmma=True)


def attention_config(num_heads: int, device: torch.device) -> DecodeConfig:
    """The split kernel's tiles for `num_heads` heads on `device`, whatever the row count."""
    if device.type == "cuda" and num_heads >= 64:
        return _GPU_CONFIG_64_HEADS
    return decode_config(num_heads, device)


def invariant_window_entry_attention(q: torch.Tensor, window_cache: LatentCache, block_table: torch.Tensor,
                                     key_lens: torch.Tensor, sinks: torch.Tensor, *, softmax_scale: float,
                                     sliding_window: int, entry_cache: LatentCache | None = None,
                                     entry_table: torch.Tensor | None = None,
                                     entry_indices: torch.Tensor | None = None,
                                     compress_rate: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `reference.v4_paged.window_entry_attention`: one split a row, one tile configuration.

    q [n, H, D]; window_cache [nb, bs, D] (a tensor or an `FP8LatentCache`, the entries' of its type); block_table [n, W] int32; key_lens [n] int32; sinks [H];
    entry_cache [nbg, bsg, D], entry_table [n, Wg] int32, entry_indices [n, k] int32 or None
    -> out [n, H, D] in q's dtype, lse [n, H] float32.
    """
    return window_entry_attention(q, window_cache, block_table, key_lens, sinks, softmax_scale=softmax_scale,
                                  sliding_window=sliding_window, entry_cache=entry_cache, entry_table=entry_table,
                                  entry_indices=entry_indices, compress_rate=compress_rate, num_splits=1,
                                  config=attention_config(q.shape[1], q.device))


def invariant_index_scores(q: torch.Tensor, head_weights: torch.Tensor, index_cache: IndexCache,
                           block_table: torch.Tensor, key_lens: torch.Tensor, *,
                           weight_scale: float = 1.0) -> torch.Tensor:
    """Contract of `reference.dsa.index_scores` with one tile configuration for every row count:
    q [T, Hi, Di]; head_weights [T, Hi] float32; index_cache [nb, bs, Di] (or an `FP8IndexCache`);
    block_table [T, W] int32; key_lens [T] int32 -> scores [T, W * bs] float32."""
    config = _GPU_INDEXER if q.device.type == "cuda" else indexer_config(q.device)
    return index_scores(q, head_weights, index_cache, block_table, key_lens, weight_scale=weight_scale,
                        config=config)


def invariant_layout(dim: int) -> StreamsLayout:
    """The streams pass's layout at every token count: blocks of 16 tokens through the dot product, D in
    slices of _SLICE_CHUNKS chunks (D alone decides them)."""
    total = triton.cdiv(dim, _BLOCK_D)
    chunks = min(_SLICE_CHUNKS, total)
    return StreamsLayout(block_dot=True, block_t=_MAX_BLOCK_T, slices=triton.cdiv(total, chunks), chunks=chunks)


def invariant_hc_site(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      norm_weight: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contract of `reference.v4_hc.hc_site`, the streams pass in `invariant_layout`: streams [T, N, D] ->
    (x [T, D], post [T, N], comb [T, N, N] float32)."""
    return hc_site(streams, fn, base, scale, norm_weight, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                   layout=invariant_layout(streams.shape[-1]))


def invariant_hc_write_back(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor,
                            streams: torch.Tensor) -> torch.Tensor:
    """Contract of `reference.v4_hc.hc_write_back` in `invariant_layout`: post [T, N], comb [T, N, N] float32;
    out [T, D]; streams [T, N, D] -> new streams [T, N, D]."""
    return hc_write_back(post, comb, out, streams, layout=invariant_layout(streams.shape[-1]))


def invariant_hc_write_back_site(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor,
                                 fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor,
                                 *, iters: int, hc_eps: float, norm_eps: float
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contract of `reference.v4_hc.hc_write_back_site` in `invariant_layout` -> (new streams [T, N, D],
    x [T, D], post [T, N], comb [T, N, N])."""
    return hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, iters=iters, hc_eps=hc_eps,
                              norm_eps=norm_eps, layout=invariant_layout(streams.shape[-1]))


def invariant_hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                      hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Contract of `reference.v4_hc.hc_head` in `invariant_layout`: streams [T, N, D]; fn [N, N * D], base [N],
    scale [1] float32 -> [T, D] in the streams' dtype."""
    return hc_head(streams, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps,
                   layout=invariant_layout(streams.shape[-1]))
