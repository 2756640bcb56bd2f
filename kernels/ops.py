"""The op tables' types: one frozen dataclass per group of ops, and `Ops`, the table the model calls.

Each field is one op, typed by its contract (`contracts`). A backend's table is a value of
`Ops` (the reference's is `reference.table.REFERENCE`); `registry.ops_for` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import contracts as c


@dataclass(frozen=True, slots=True)
class DenseOps:
    """Ops every layer kind uses: projections, norms, rope, merging partial attention by LSE."""

    linear: c.Linear
    logits: c.Logits
    rms_norm: c.RmsNorm
    layer_norm: c.LayerNorm
    rms_norm_linear: c.RmsNormLinear
    rope: c.Rope
    partial_rope: c.PartialRope
    merge_attn_states: c.MergeAttnStates


@dataclass(frozen=True, slots=True)
class MLAOps:
    """Multi-head Latent Attention: the paged latent cache and the two attention paths."""

    write_kv: c.WriteKv
    write_latent: c.WriteLatent
    write_latent_absorb: c.WriteLatentAbsorb
    absorb_query: c.AbsorbQuery
    mla_decode: c.MlaDecode
    prefill_attention: c.PrefillAttention


@dataclass(frozen=True, slots=True)
class MoEOps:
    """Mixture of experts: routing and the fused expert sum."""

    route: c.Route
    fused_moe: c.FusedMoe


@dataclass(frozen=True, slots=True)
class DSAOps:
    """DeepSeek Sparse Attention: the indexer-key cache, index scores, top-k, sparse MLA over the chosen rows."""

    write_index_key: c.WriteIndexKey
    index_scores: c.IndexScores
    top_k_indices: c.TopKIndices
    sparse_mla_decode: c.SparseMlaDecode


@dataclass(frozen=True, slots=True)
class V4Ops:
    """DeepSeek-V4's own math: partial rope, the unweighted norm, attention over the window and the
    compressed entries with the sink, the compressors' update, whole mHC sites (with the write-back
    before them), write-backs and the hyper head, and the clamped-SwiGLU experts."""

    rope_tail: c.RopeTail
    unit_rms: c.UnitRms
    window_entry_attention: c.WindowEntryAttention
    compress_entries: c.CompressEntries
    hc_site: c.HcSite
    hc_write_back: c.HcWriteBack
    hc_write_back_site: c.HcWriteBackSite
    hc_head: c.HcHead
    clamped_experts: c.ClampedExperts


# A group of its own rather than `dense`: no layer kind calls it (the engine draws tokens from
# the forward's logits), and it is row-local, so every table, batch-invariant or not, keeps it.
@dataclass(frozen=True, slots=True)
class SamplingOps:
    """Drawing tokens from logits: the seeded Gumbel-max draw (greedy rows take the argmax)."""

    gumbel_max: c.GumbelMax


# A group of its own: no kernel backend replaces it; a table is bound to a process group by
# `collectives.with_collectives`, which makes a new table, so one pure forward serves 1 or N ranks.
@dataclass(frozen=True, slots=True)
class CollectiveOps:
    """Sums and gathers over the ranks a model is sharded across (`collectives`).

    size: ranks in the group (1: every op is the identity); rank: this process's place in it.
    tokens_split: each rank's steps hold its own requests' rows (data-parallel attention): the
                  blocks the ranks share gather every rank's rows and scatter the sums back,
                  while attention runs whole on each rank (`mla_func.core.exchange`).
    """

    size: int
    rank: int
    all_reduce: c.AllReduce
    all_gather: c.AllGather
    reduce_scatter: c.ReduceScatter
    tokens_split: bool = False


@dataclass(frozen=True, slots=True)
class Ops:
    """Every op the model calls (and the engine's token draw), bound to one backend's implementations, by
    layer kind.

    batch_invariant: every op gives each output row bits that depend on that row's
    inputs only (not on the number or content of the other rows); see
    `reference.invariant` and `triton.invariant` for how each backend does it.
    w8a8: the products of FP8 weights quantize their activations per token and group of K (the
    checkpoints' "dynamic" activation scheme; `reference.w8a8`, `triton.fp8_ops.w8a8_ops`); otherwise
    they multiply by the dequantized weight.
    """

    backend: str
    dense: DenseOps
    mla: MLAOps
    moe: MoEOps
    dsa: DSAOps
    v4: V4Ops
    sampling: SamplingOps
    collectives: CollectiveOps
    batch_invariant: bool = False
    w8a8: bool = False
