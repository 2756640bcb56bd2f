"""The op registry: one contract per op, one implementation per backend, chosen explicitly.

The model calls ops only through an `Ops` table (`ops`) obtained from `ops_for(backend)`.
Ops are grouped by the layer kind that needs them: `dense` (norms, projections,
rope, the LSE merge: every layer kind), `mla` (the latent cache and MLA
attention), `moe` (routing and experts), `dsa` (DeepSeek Sparse Attention's
indexer and sparse MLA, which DeepSeek-V4's CSA layers share), `v4` (DeepSeek-V4's
own math: attention over the paged window and entries, the compressors' update); a new layer
kind adds a group; `sampling` holds the token draw from the forward's logits, which
the engine (not the model) calls. Each op's contract is its `Protocol` in
`contracts`. Every backend's table derives from the reference table
(`reference.table.REFERENCE`) with `dataclasses.replace`, naming only the ops it replaces, so an op a backend has no
kernel for is visibly the reference. The backends' modules import the table types and the
reference table, never this module, so choosing a backend here (imported only when asked
for, so that the CPU path never imports Triton) makes no import cycle.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from .held_experts import HeldExperts
from .ops import Ops
from .reference.table import REFERENCE

BACKENDS = ("torch", "triton", "aiter")


def _torch_ops(batch_invariant: bool, w8a8: bool) -> Ops:
    if w8a8:
        from .reference import w8a8 as ref_w8a8

        return ref_w8a8.w8a8_ops(REFERENCE)
    if not batch_invariant:
        return REFERENCE
    from .reference import invariant as ref_invariant

    return ref_invariant.invariant_ops(REFERENCE)


def _triton_ops(batch_invariant: bool, w8a8: bool) -> Ops:
    from . import triton as triton_kernels

    if w8a8:
        from .triton import fp8_ops

        return fp8_ops.w8a8_ops(triton_kernels.ops())
    if not batch_invariant:
        return triton_kernels.ops()
    from .triton import invariant as triton_invariant

    return triton_invariant.invariant_ops(triton_kernels.ops())


def _aiter_ops(batch_invariant: bool, w8a8: bool) -> Ops:
    from . import aiter as aiter_kernels

    if batch_invariant or w8a8:
        raise ValueError(f"backend 'aiter' has no {'batch-invariant' if batch_invariant else 'w8a8'} op table; use "
                         f"backend='triton' or {'batch_invariant' if batch_invariant else 'w8a8'}=False")
    return aiter_kernels.ops()


_TABLES: dict[str, Callable[[bool, bool], Ops]] = {"torch": _torch_ops, "triton": _triton_ops, "aiter": _aiter_ops}


@functools.cache
def ops_for(backend: str, batch_invariant: bool = False, w8a8: bool = False) -> Ops:
    """The op table of `backend` ("torch", "triton" or "aiter"): batch-invariant if asked, or with w8a8
    FP8 products (`Ops.w8a8`) if asked. Not both: the w8a8 products keep no one K order for every row
    count (ValueError)."""
    if backend not in _TABLES:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if batch_invariant and w8a8:
        raise ValueError("batch_invariant=True and w8a8=True: the batch-invariant tables multiply FP8 weights by "
                         "16-bit activations in one K order; no table quantizes activations batch-invariantly")
    return _TABLES[backend](batch_invariant, w8a8)


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
                        fixed_ids: torch.Tensor | None = None,
                        held: HeldExperts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        topk_weights, topk_ids = route(
            x, gate, e_score_correction_bias, valid, top_k=top_k, scoring_func=scoring_func,
            topk_method=topk_method, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor, num_shared=num_shared, fixed_ids=fixed_ids, held=held)
        chosen.append(topk_ids[:, :top_k])
        return topk_weights, topk_ids

    return dataclasses.replace(ops, moe=dataclasses.replace(ops.moe, route=recording_route)), chosen
