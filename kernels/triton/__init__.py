"""Triton kernels for NVIDIA GPUs (and the CPU interpreter under TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses

from ..ops import Ops
from ..reference.table import REFERENCE
from .absorb import absorb_query
from .cache import write_kv
from .decode import mla_decode, mla_decode_num_splits, mla_decode_workspace
from .dsa_decode import sparse_mla_decode
from .dsa_indexer import index_scores, write_index_key
from .dsa_topk import top_k_indices
from .fp4_experts import QuantizedClampedExperts
from .fp8_heads import Fp8HeadsMlaDecode, Fp8HeadsSparseMlaDecode, Fp8HeadsWriteLatentAbsorb
from .fp8_ops import Fp8FusedMoe, Fp8Linear, Fp8RmsNormLinear
from .latent import write_latent, write_latent_absorb
from .linear import linear, logits, rms_norm_linear
from .merge import merge_attn_states
from .moe import fused_moe
from .norm import layer_norm, rms_norm
from .prefill import prefill_attention
from .rope import partial_rope, rope
from .routing import route
from .sampling import gumbel_max
from .v4_attention import window_entry_attention
from .v4_compress import compress_entries
from .v4_experts import clamped_experts
from .v4_hc_site import hc_head, hc_site, hc_write_back, hc_write_back_site
from .v4_norm import unit_rms
from .v4_rope import rope_tail

__all__ = [
    "absorb_query",
    "clamped_experts",
    "compress_entries",
    "fused_moe",
    "gumbel_max",
    "hc_head",
    "hc_site",
    "hc_write_back",
    "hc_write_back_site",
    "index_scores",
    "layer_norm",
    "linear",
    "logits",
    "merge_attn_states",
    "mla_decode",
    "mla_decode_num_splits",
    "mla_decode_workspace",
    "ops",
    "partial_rope",
    "prefill_attention",
    "rms_norm",
    "rms_norm_linear",
    "rope",
    "rope_tail",
    "route",
    "sparse_mla_decode",
    "top_k_indices",
    "unit_rms",
    "window_entry_attention",
    "write_index_key",
    "write_kv",
    "write_latent",
    "write_latent_absorb",
]


# FP4 and FP8 experts read by their own kernels (`fp4_experts`); one value, so every table built from
# this one holds the same op.
_CLAMPED_EXPERTS = QuantizedClampedExperts(clamped_experts)


def ops() -> Ops:
    """The Triton op table: a kernel for every op (FP8 weights to the FP8 kernels, `fp8_ops`, `fp8_heads`;
    FP4 experts to `fp4_experts`)."""
    return dataclasses.replace(
        REFERENCE,
        backend="triton",
        dense=dataclasses.replace(REFERENCE.dense, linear=Fp8Linear(linear), logits=logits, rms_norm=rms_norm,
                                  layer_norm=layer_norm, rms_norm_linear=Fp8RmsNormLinear(rms_norm_linear, linear),
                                  rope=rope,
                                  partial_rope=partial_rope, merge_attn_states=merge_attn_states),
        mla=dataclasses.replace(REFERENCE.mla, write_kv=write_kv, write_latent=write_latent,
                                write_latent_absorb=Fp8HeadsWriteLatentAbsorb(write_latent_absorb),
                                absorb_query=absorb_query, mla_decode=Fp8HeadsMlaDecode(mla_decode),
                                prefill_attention=prefill_attention),
        moe=dataclasses.replace(REFERENCE.moe, route=route, fused_moe=Fp8FusedMoe(fused_moe)),
        dsa=dataclasses.replace(REFERENCE.dsa, write_index_key=write_index_key, index_scores=index_scores,
                                top_k_indices=top_k_indices, sparse_mla_decode=Fp8HeadsSparseMlaDecode(sparse_mla_decode)),
        v4=dataclasses.replace(REFERENCE.v4, rope_tail=rope_tail, unit_rms=unit_rms,
                               window_entry_attention=window_entry_attention, compress_entries=compress_entries,
                               hc_site=hc_site, hc_write_back=hc_write_back,
                               hc_write_back_site=hc_write_back_site, hc_head=hc_head,
                               clamped_experts=_CLAMPED_EXPERTS),
        sampling=dataclasses.replace(REFERENCE.sampling, gumbel_max=gumbel_max),
    )
