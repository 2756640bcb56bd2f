"""The op registry: one contract per op, one implementation per backend, chosen explicitly.

The model calls ops only through an `Ops` table obtained from `ops_for(backend)`.
Ops are grouped by the layer kind that needs them: `dense` (norms, projections,
rope, the LSE merge: every layer kind), `mla` (the latent cache and MLA
attention), `moe` (routing and experts), `dsa` (DeepSeek Sparse Attention's
indexer and sparse MLA, which DeepSeek-V4's CSA layers share), `v4` (DeepSeek-V4's
own math: attention over the paged window and entries, the compressors' update); a new layer
kind adds a group; `sampling` holds the token draw from the forward's logits, which
the engine (not the model) calls. Each op's contract is its `Protocol` in
`contracts`. Every backend's table derives from the reference table with
`dataclasses.replace`, naming only the ops it replaces, so an op a backend has no
kernel for is visibly the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import contracts as c
from .reference import attention as ref_attention
from .reference import cache as ref_cache
from .reference import dsa as ref_dsa
from .reference import latent as ref_latent
from .reference import linear as ref_linear
from .reference import moe as ref_moe
from .reference import norm as ref_norm
from .reference import rope as ref_rope
from .reference import routing as ref_routing
from .reference import sampling as ref_sampling
from .reference import v4_attention as ref_v4_attention
from .reference import v4_hc as ref_v4_hc
from .reference import v4_moe as ref_v4_moe
from .reference import v4_paged as ref_v4_paged

BACKENDS = ("torch", "triton", "aiter")


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


@dataclass(frozen=True, slots=True)
class Ops:
    """Every op the model calls (and the engine's token draw), bound to one backend's implementations, by
    layer kind.

    batch_invariant: every op gives each output row bits that depend on that row's
    inputs only (not on the number or content of the other rows); see
    `reference.invariant` and `triton.invariant` for how each backend does it.
    """

    backend: str
    dense: DenseOps
    mla: MLAOps
    moe: MoEOps
    dsa: DSAOps
    v4: V4Ops
    sampling: SamplingOps
    batch_invariant: bool = False


REFERENCE = Ops(
    backend="torch",
    dense=DenseOps(
        linear=ref_linear.linear,
        logits=ref_linear.logits_of(ref_linear.linear),
        rms_norm=ref_norm.rms_norm,
        layer_norm=ref_norm.layer_norm,
        rms_norm_linear=ref_linear.rms_norm_linear,
        rope=ref_rope.rope,
        partial_rope=ref_rope.partial_rope,
        merge_attn_states=ref_attention.merge_attn_states,
    ),
    mla=MLAOps(
        write_kv=ref_cache.write_kv,
        write_latent=ref_latent.write_latent,
        write_latent_absorb=ref_latent.write_latent_absorb,
        absorb_query=ref_attention.absorb_query,
        mla_decode=ref_attention.mla_decode,
        prefill_attention=ref_attention.prefill_attention,
    ),
    moe=MoEOps(route=ref_routing.route, fused_moe=ref_moe.fused_moe),
    dsa=DSAOps(
        write_index_key=ref_dsa.write_index_key,
        index_scores=ref_dsa.index_scores,
        top_k_indices=ref_dsa.top_k_indices,
        sparse_mla_decode=ref_dsa.sparse_mla_decode,
    ),
    v4=V4Ops(
        rope_tail=ref_v4_attention.rope_tail,
        unit_rms=ref_v4_attention.unit_rms,
        window_entry_attention=ref_v4_paged.window_entry_attention,
        compress_entries=ref_v4_paged.compress_entries,
        hc_site=ref_v4_hc.hc_site,
        hc_write_back=ref_v4_hc.hc_write_back,
        hc_write_back_site=ref_v4_hc.hc_write_back_site,
        hc_head=ref_v4_hc.hc_head,
        clamped_experts=ref_v4_moe.clamped_experts,
    ),
    sampling=SamplingOps(gumbel_max=ref_sampling.gumbel_max),
)


def _torch_ops(batch_invariant: bool) -> Ops:
    if not batch_invariant:
        return REFERENCE
    from .reference import invariant as ref_invariant

    return ref_invariant.invariant_ops(REFERENCE)


def _triton_ops(batch_invariant: bool) -> Ops:
    from . import triton as triton_kernels

    if not batch_invariant:
        return triton_kernels.ops()
    from .triton import invariant as triton_invariant

    return triton_invariant.invariant_ops(triton_kernels.ops())


def _aiter_ops(batch_invariant: bool) -> Ops:
    from . import aiter as aiter_kernels

    if batch_invariant:
        raise ValueError("backend 'aiter' has no batch-invariant op table; use backend='triton' or "
                         "batch_invariant=False")
    return aiter_kernels.ops()


_TABLES: dict[str, Callable[[bool], Ops]] = {"torch": _torch_ops, "triton": _triton_ops, "aiter": _aiter_ops}


@functools.cache
def ops_for(backend: str, batch_invariant: bool = False) -> Ops:
    """The op table of `backend` ("torch", "triton" or "aiter"), batch-invariant if asked."""
    if backend not in _TABLES:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return _TABLES[backend](batch_invariant)


def default_backend(device: torch.device | str) -> str:
    """"triton" on CUDA devices, "torch" elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


def record_expert_choice(ops: Ops) -> tuple[Ops, list[torch.Tensor]]:
    """`ops` whose route also appends each call's routed choice, topk_ids [T, k], to the returned list.

    For measuring routing (expert loads, bytes a step reads) through the public
    `ops=` argument of the forward, in call order: one entry per MoE layer. Shared
    experts, which every token takes, are not in the record.
    """
    chosen: list[torch.Tensor] = []
    route = ops.moe.route

    def recording_route(x: torch.Tensor, gate: torch.Tensor, e_score_correction_bias: torch.Tensor | None,
                        valid: torch.Tensor, /, *, top_k: int, scoring_func: str, topk_method: str,
                        n_group: int | None, topk_group: int | None, norm_topk_prob: bool,
                        routed_scaling_factor: float, num_shared: int = 0,
                        fixed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        topk_weights, topk_ids = route(
            x, gate, e_score_correction_bias, valid, top_k=top_k, scoring_func=scoring_func,
            topk_method=topk_method, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor, num_shared=num_shared, fixed_ids=fixed_ids)
        chosen.append(topk_ids[:, :top_k])
        return topk_weights, topk_ids

    return dataclasses.replace(ops, moe=dataclasses.replace(ops.moe, route=recording_route)), chosen
