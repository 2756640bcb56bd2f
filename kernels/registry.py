"""The op registry: one contract per op, one implementation per backend, chosen explicitly.

The model calls ops only through an `Ops` table obtained from `ops_for(backend)`.
Each backend's table names an implementation for every op; where a backend has
no kernel of its own for an op, its table says so by naming the reference, so
nothing falls back silently.

Contracts (shapes in the docstrings of the reference implementations):

    linear(x, weight, *, out_dtype=None) -> y
    rms_norm_linear(x, norm_weight, eps, weight, residual=None) -> y | (y, residual_out)
    write_kv(kv_cache, slot_mapping, kv, *, inplace=True) -> kv_cache
    write_latent(kv_cache, slot_mapping, latent, kv_a_norm, q_pe, positions, cos, sin, *, eps, interleaved,
                 inplace=True) -> (kv_cache, q_pe)
    write_latent_absorb(kv_cache, slot_mapping, latent, kv_a_norm, q_nope, q_pe, w_uk, positions, cos, sin, *,
                        eps, interleaved, absorb_from, inplace=True) -> (kv_cache, q_pe, q)
    absorb_query(q_nope, q_pe, w_uk) -> q
    mla_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, w_uv=None, q_len=1) -> (out, lse)
    prefill_attention(q_nope, q_pe, kv_cache, block_table, cu_seqlens_q, seq_lens, positions,
                      w_uk, w_uv, *, softmax_scale) -> (out, lse)
    merge_attn_states(out_a, lse_a, out_b, lse_b) -> (out, lse)
    route(x, gate, e_score_correction_bias, valid, *, top_k, scoring_func, topk_method, n_group,
          topk_group, norm_topk_prob, routed_scaling_factor, num_shared=0) -> (topk_weights, topk_ids)
    fused_moe(x, w13, w2, topk_weights, topk_ids, *, out_dtype=None) -> y
    rms_norm(x, weight, eps, residual=None) -> y | (y, residual_out)
    rope(q_pe, k_pe, positions, cos, sin, *, interleaved) -> (q_pe, k_pe)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .reference import attention as ref_attention
from .reference import cache as ref_cache
from .reference import latent as ref_latent
from .reference import linear as ref_linear
from .reference import moe as ref_moe
from .reference import norm as ref_norm
from .reference import rope as ref_rope
from .reference import routing as ref_routing

BACKENDS = ("torch", "triton", "aiter")


@dataclass(frozen=True, slots=True)
class Ops:
    """Every op the model calls, bound to one backend's implementations."""

    backend: str
    linear: Callable
    rms_norm_linear: Callable
    write_kv: Callable
    write_latent: Callable
    write_latent_absorb: Callable
    absorb_query: Callable
    mla_decode: Callable
    prefill_attention: Callable
    merge_attn_states: Callable
    route: Callable
    fused_moe: Callable
    rms_norm: Callable
    rope: Callable


def _torch_ops() -> Ops:
    return Ops(
        backend="torch",
        linear=ref_linear.linear,
        rms_norm_linear=ref_linear.rms_norm_linear,
        write_kv=ref_cache.write_kv,
        write_latent=ref_latent.write_latent,
        write_latent_absorb=ref_latent.write_latent_absorb,
        absorb_query=ref_attention.absorb_query,
        mla_decode=ref_attention.mla_decode,
        prefill_attention=ref_attention.prefill_attention,
        merge_attn_states=ref_attention.merge_attn_states,
        route=ref_routing.route,
        fused_moe=ref_moe.fused_moe,
        rms_norm=ref_norm.rms_norm,
        rope=ref_rope.rope,
    )


def _triton_ops() -> Ops:
    from . import triton as triton_kernels

    return triton_kernels.ops()


def _aiter_ops() -> Ops:
    from . import aiter as aiter_kernels

    return aiter_kernels.ops()


_TABLES: dict[str, Callable[[], Ops]] = {"torch": _torch_ops, "triton": _triton_ops, "aiter": _aiter_ops}


@functools.cache
def ops_for(backend: str) -> Ops:
    """The op table of `backend` ("torch", "triton" or "aiter")."""
    if backend not in _TABLES:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return _TABLES[backend]()


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
    route = ops.route

    def recording_route(*args, top_k, **kwargs):
        topk_weights, topk_ids = route(*args, top_k=top_k, **kwargs)
        chosen.append(topk_ids[:, :top_k])
        return topk_weights, topk_ids

    return dataclasses.replace(ops, route=recording_route), chosen
