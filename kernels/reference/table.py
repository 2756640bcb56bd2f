"""The reference op table: every op's plain-PyTorch implementation, the table every backend's derives from."""

from __future__ import annotations

from ..collectives import SINGLE_PROCESS
from ..ops import DenseOps, DSAOps, MLAOps, MoEOps, Ops, SamplingOps, V4Ops
from . import attention as ref_attention
from . import cache as ref_cache
from . import dsa as ref_dsa
from . import latent as ref_latent
from . import linear as ref_linear
from . import moe as ref_moe
from . import norm as ref_norm
from . import rope as ref_rope
from . import routing as ref_routing
from . import sampling as ref_sampling
from . import v4_attention as ref_v4_attention
from . import v4_hc as ref_v4_hc
from . import v4_moe as ref_v4_moe
from . import v4_paged as ref_v4_paged


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
    collectives=SINGLE_PROCESS,
)
