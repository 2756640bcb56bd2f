"""DeepSeek-V4's attention of one layer: shared-KV heads over a sliding window, compressed entries and a sink.

Every head's query attends to one shared key per token, which is also the value
(K = V). Each row (a query token at position p) sees

* its window: the keys of positions [p - sliding_window + 1, p] of its sequence;
* HCA layers: every compressed entry complete at p (entries of `rate` tokens);
* CSA layers: the `index_topk` complete entries the lightning indexer scores best;
* a per-head sink: a logit in the softmax that carries no value.

Each is a scope of its own, attended separately; their partial results meet in the
one LSE merge (`merge_attn_states`), the sink as a scope of one logit and a zero value.

Partial RoPE rotates the trailing `qk_rope_head_dim` channels of queries and
keys (and compressed entries, at their block's first position); as values carry
that rotation too, the output's rope slice is rotated back at the query's
position. Heads are then projected in `o_groups` groups (`o_a_proj`), mixed by
`o_b_proj`.

The caches are written first (window keys, compressor inputs, completed entries),
then each segment's rows (prefill, then decode) read their own keys through their
own block tables: slices (`RowMetadata.segments`) of the step's per-row view, which
the forward builds once a step (`LayerContext.rows`, `rows.row_metadata`). Prefill
and decode rows take the same per-row path, each with its own segment's metadata, so a
batch-invariant step (`mode.batch_invariant`, the invariant op table) takes it too; its one
change is the grouped output product, which goes through the table's `linear` a group at a
time (`grouped_projection`).
"""

from __future__ import annotations

import torch

from mla_func.core.batch import Batch
from mla_func.core.config import ModelConfig
from mla_func.core.exchange import attention_output
from mla_func.core.mode import ForwardMode
from mla_func.core.rows import RowMetadata, SegmentRows
from mla_func.kernels import Ops
from mla_func.models.v4.compressor import write_entries
from mla_func.models.v4.config import CSA, V4Config, v4_fields
from mla_func.models.v4.indexer import index_query, select_entries
from mla_func.models.v4.params import V4AttentionParams
from mla_func.state.v4_cache import V4LayerCache


def _seqs(mode: ForwardMode, segment: SegmentRows) -> int:
    return mode.padded_prefill_seqs if segment.start == 0 and mode.padded_prefill_tokens else mode.padded_decode_seqs


def write_caches(p: V4AttentionParams, kv: torch.Tensor, compressor_inputs: torch.Tensor, index_inputs: torch.Tensor,
                 cache: V4LayerCache, batch: Batch, mode: ForwardMode, segments: tuple[SegmentRows, ...],
                 layer_type: str, config: ModelConfig, ops: Ops, *, inplace: bool) -> V4LayerCache:
    """This step's window keys, compressor inputs and completed entries (and CSA's index keys) written.

    kv [T, Dh]; compressor_inputs [T, Cc], index_inputs [T, Ci]: this step's tokens' projections
    (columns of the layer's input product; Cc, Ci 0 where the layer has no such compressor).
    """
    v = v4_fields(config)
    window = ops.mla.write_kv(cache.window, batch.slot_mapping, kv, inplace=inplace)
    if p.compressor is None or cache.compressor_inputs is None or cache.entries is None:
        return V4LayerCache(window=window)
    rate = v.rate(layer_type)
    eps = config.rms_norm_eps
    group_slots = batch.groups[cache.entry_group - 1].slot_mapping
    inputs = ops.mla.write_kv(cache.compressor_inputs, batch.slot_mapping, compressor_inputs, inplace=inplace)
    index_cache, index_keys = cache.index_inputs, cache.index_keys
    if p.indexer is not None and index_cache is not None:
        index_cache = ops.mla.write_kv(index_cache, batch.slot_mapping, index_inputs, inplace=inplace)
    entries = cache.entries
    for seg in segments:
        slots, seqs = group_slots[seg.start:seg.stop], _seqs(mode, seg)
        entries = write_entries(p.compressor, inputs, entries, slots, seg.key_lens, seg.block_table, rate=rate,
                                overlap=layer_type == CSA, num_seqs=seqs, cos=p.rope_cos, sin=p.rope_sin, eps=eps,
                                ops=ops, inplace=inplace)
        if p.indexer is not None and index_cache is not None and index_keys is not None:
            index_keys = write_entries(p.indexer.compressor, index_cache, index_keys, slots, seg.key_lens,
                                       seg.block_table, rate=rate, overlap=True, num_seqs=seqs, cos=p.rope_cos,
                                       sin=p.rope_sin, eps=eps, ops=ops, inplace=inplace)
    return V4LayerCache(window=window, compressor_inputs=inputs, entries=entries, index_inputs=index_cache,
                        index_keys=index_keys, group=cache.group, entry_group=cache.entry_group)


def segment_attention(p: V4AttentionParams, cache: V4LayerCache, seg: SegmentRows, q: torch.Tensor,
                      q_index: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, layer_type: str,
                      v: V4Config, ops: Ops) -> torch.Tensor:
    """The attention output [n, H, Dh] of a segment's rows (q [n, H, Dh], rotated; q_index [n, Hi * Di]
    the indexer's query projection, empty without an indexer).

    Scopes: the row's window, and its compressed entries (all complete ones for HCA,
    the indexer's top-k for CSA), merged by their log-sum-exp with the sink: a scope
    of one logit per head and a zero value. The op reads both scopes from the paged
    caches through the row's own tables.
    """
    scale = v.head_dim ** -0.5
    if cache.entries is None:
        out, _ = ops.v4.window_entry_attention(q, cache.window, seg.block_table, seg.key_lens, p.sinks,
                                               softmax_scale=scale, sliding_window=v.sliding_window)
        return out
    rate = v.rate(layer_type)
    g_table = seg.group_tables[cache.entry_group - 1]
    chosen = None
    if p.indexer is not None and cache.index_keys is not None:
        q_index, head_weights = index_query(p.indexer, q_index, x, positions, p.rope_cos, p.rope_sin, v, ops)
        counts = seg.key_lens // rate
        chosen = select_entries(q_index, head_weights, cache.index_keys, g_table, counts, v, ops)
    out, _ = ops.v4.window_entry_attention(q, cache.window, seg.block_table, seg.key_lens, p.sinks,
                                           softmax_scale=scale, sliding_window=v.sliding_window,
                                           entry_cache=cache.entries, entry_table=g_table, entry_indices=chosen,
                                           compress_rate=rate)
    return out


def v4_attention(p: V4AttentionParams, x: torch.Tensor, cache: V4LayerCache, batch: Batch, mode: ForwardMode,
                 layer_type: str, config: ModelConfig, ops: Ops, *, inplace: bool, rows: RowMetadata | None
                 ) -> tuple[torch.Tensor, V4LayerCache]:
    """x [T, D] (the layer's normalised input) -> (output [T, D], the cache with this step written).

    rows: the step's per-row view (`LayerContext.rows`: key_lens [T], block_table [T, W], group_tables
          [T, W_g] per cache group 1..); every row of every segment attends through it.
    """
    if rows is None:
        raise ValueError("v4_attention: the step's row metadata (LayerContext.rows) is missing: the forward builds "
                         "it when rows.rows_needed holds (the family attends by row)")
    v = v4_fields(config)
    # The heads these params hold: a tensor-parallel rank's share (`shard`), every head otherwise.
    t, h, dh = x.shape[0], p.sinks.shape[0], v.head_dim
    eps = config.rms_norm_eps
    positions = batch.positions
    # The rope tables [P, R / 2] are read at each token's position inside the op.
    cos, sin = p.rope_cos, p.rope_sin
    # One product for every projection of x, where there were up to four: at v4-mini's batch 64 a step's
    # 13 small cuBLAS products and their split-K reductions became 4 (H100: 2.52 -> 2.45 ms).
    q_a, kv, compressor_inputs, index_inputs = ops.dense.linear(x, p.in_proj).split(p.input_widths, dim=1)
    q_residual = ops.dense.rms_norm(q_a, p.q_a_norm, eps)                                 # [T, Q]
    # The indexer's queries come from the same latent: their rows follow the attention's in q_b_proj.
    q, q_index = ops.dense.linear(q_residual, p.q_b_proj).split([h * dh, p.q_b_proj.shape[0] - h * dh], dim=1)
    q = ops.v4.rope_tail(q.view(t, h, dh), cos, sin, positions=positions, unit_rms_eps=eps)  # [T, H, Dh]
    kv = ops.v4.rope_tail(ops.dense.rms_norm(kv, p.kv_norm, eps), cos, sin, positions=positions)  # [T, Dh]
    segments = rows.segments(mode)
    cache = write_caches(p, kv, compressor_inputs, index_inputs, cache, batch, mode, segments, layer_type, config,
                         ops, inplace=inplace)
    outputs = []
    for seg in segments:
        span = slice(seg.start, seg.stop)
        outputs.append(segment_attention(p, cache, seg, q[span], q_index[span], x[span], positions[span],
                                         layer_type, v, ops))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)                   # [T, H, Dh]
    out = ops.v4.rope_tail(out, cos, sin, positions=positions, inverse=True)
    groups = p.o_a_proj.shape[0] // v.o_lora_rank  # whole groups: all G, or a tensor-parallel rank's G / n
    o_a = p.o_a_proj.view(groups, -1, p.o_a_proj.shape[-1])                                 # [G, Og, H * Dh / G]
    grouped = grouped_projection(out.reshape(t, groups, -1), o_a, ops)                     # [T, G * Og]
    # A rank's groups give a partial sum of o_b_proj's product: the ranks' sum is the output (`core.exchange`).
    return attention_output(ops.dense.linear(grouped, p.o_b_proj), ops.collectives), cache


def grouped_projection(x: torch.Tensor, o_a: torch.Tensor, ops: Ops) -> torch.Tensor:
    """Each group's heads through that group's o_a: x [T, G, I], o_a [G, Og, I] -> [T, G * Og] (group-major).

    One batched product by default. A batch-invariant table takes a product per group through its
    `linear` instead: a batched GEMM's algorithm, and so a row's last bits, follows the row count.
    """
    if ops.batch_invariant:
        return torch.cat([ops.dense.linear(x[:, g], o_a[g]) for g in range(o_a.shape[0])], dim=1)
    return torch.einsum("tgi,goi->tgo", x, o_a).flatten(1)
