"""The params of a multi-token-prediction (MTP) layer, and their tensors in a Hugging Face checkpoint.

DeepSeek-V3 checkpoints store `num_nextn_predict_layers` MTP layers after the
decoder layers, as `model.layers.{L}.` with L = num_hidden_layers (and up):

    enorm.weight [D], hnorm.weight [D]      norms of the token's embedding and of the previous hidden state
    eh_proj.weight [D, 2D]                  the projection of [enorm(embedding); hnorm(hidden)]
    (a full decoder layer: input_layernorm, self_attn.*, post_attention_layernorm, mlp.*)
    shared_head.norm.weight [D]             the norm before the output head
    shared_head.head.weight [V, D]          optional: the output head (the model's lm_head when absent)
    embed_tokens.weight [V, D]              optional: the embedding (the model's when absent)

The embedding and head are the model's own in DeepSeek-V3 (the checkpoint holds copies):
a copy equal to the model's tensor is replaced by it, so memory holds one.

A sharded model's MTP layer is cut as its decoder layers are (the family's `tensor_split` names the
layer's tensors by the same suffixes, and its copies of the embedding and head as vocabulary rows);
under expert parallelism its MoE block holds the rank's own routed experts (`load_mtp(parallel=)`).

`mtp_tensor_shapes`, `mtp_optional_shapes` and `load_mtp` are every family's entry points: each asks
the model's family how its MTP layer is stored (`Family.mtp`, a `core.family.MTPFamily`); the V2/V3
layout above is `mla_mtp_tensor_shapes`, `mla_mtp_optional_shapes` and `mla_load_mtp`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mla_func.checkpoint.files import CheckpointError
from mla_func.core.config import ModelConfig
from mla_func.core.family import MTPFamily
from mla_func.core.params import Params, TensorFetch, TensorGet, checked_fetch
from mla_func.models.mla.expert_shard import expert_parallel_layer
from mla_func.models.mla.params import LayerParams, layer_params
from mla_func.models.mla.tensor_shapes import layer_tensor_shapes
from mla_func.parallel.config import Parallel
from mla_func.pytree import register_dataclass

__all__ = ["MTP_OPTIONAL_TENSORS", "MTP_UNSUPPORTED", "NO_MTP_LAYER", "MTPParams", "load_mtp", "mla_load_mtp",
           "mla_mtp_optional_shapes", "mla_mtp_tensor_shapes", "mtp_family", "mtp_layer_index", "mtp_optional_shapes",
           "mtp_params_from_hf", "mtp_tensor_shapes"]

# Fixed phrases of the two errors that refuse mtp=True, for callers (the command line) to recognise:
# what follows the family's title for a family whose MTP layers are not run, and what a checkpoint
# saved without its MTP layer is told (after the folder's name).
MTP_UNSUPPORTED = "multi-token prediction is not supported"
NO_MTP_LAYER = "the checkpoint has no multi-token-prediction (MTP) layer"

# Tensors of an MTP layer that a checkpoint may leave out (the model's own are used then).
MTP_OPTIONAL_TENSORS = ("embed_tokens.weight", "shared_head.head.weight")


@register_dataclass
@dataclass(frozen=True, slots=True)
class MTPParams:
    """One MTP layer: h' = eh_proj [enorm(embed(t)); hnorm(h)], then a decoder layer, then norm and head.

    embed and head are the model's tensors unless the checkpoint holds different ones.
    """

    enorm: torch.Tensor      # [D]
    hnorm: torch.Tensor      # [D]
    eh_proj: torch.Tensor    # [D, 2D]: columns [0, D) read the embedding, [D, 2D) the hidden state
    layer: LayerParams       # the decoder layer (MLA + MLP or MoE)
    norm: torch.Tensor       # [D] shared_head.norm
    embed: torch.Tensor      # [V, D]
    head: torch.Tensor       # [V, D] shared_head.head


def mtp_family(config: ModelConfig) -> MTPFamily:
    """How the model's family stores and runs its MTP layer (`Family.mtp`). CheckpointError for a
    family whose MTP layers are not run."""
    found = config.family.mtp
    if found is None:
        raise CheckpointError(f"{config.family.title} {MTP_UNSUPPORTED}: its MTP layers are not loaded or run yet, so "
                              "speculative decoding (load_model(..., mtp=True)) cannot draft with them; load the "
                              "model with mtp=False")
    return found


def mtp_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The required tensors of the model's first MTP layer, by name, with their shapes (its family's layout)."""
    return mtp_family(config).tensor_shapes(config)


def mtp_optional_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors the model's first MTP layer may hold beside the required ones, with their shapes."""
    return mtp_family(config).optional_shapes(config)


def mtp_layer_index(config: ModelConfig, depth: int = 0) -> int:
    """The checkpoint layer index of V2/V3 MTP layer `depth` (0 is the first): it follows the decoder layers.
    CheckpointError for a family whose MTP layers are not run."""
    mtp_family(config)  # refuses a family without MTP layers before any name is made for one
    return config.num_hidden_layers + depth


def mla_mtp_tensor_shapes(config: ModelConfig, depth: int = 0) -> dict[str, tuple[int, ...]]:
    """The required tensors of V2/V3 MTP layer `depth`, by name, with their shapes (the optional ones excluded)."""
    i = mtp_layer_index(config, depth)
    d = config.hidden_size
    p = f"model.layers.{i}."
    return {p + "enorm.weight": (d,), p + "hnorm.weight": (d,), p + "eh_proj.weight": (d, 2 * d),
            p + "shared_head.norm.weight": (d,), **layer_tensor_shapes(config, i)}


def mla_mtp_optional_shapes(config: ModelConfig, depth: int = 0) -> dict[str, tuple[int, ...]]:
    """The optional tensors of V2/V3 MTP layer `depth` (embedding and head copies), with their shapes."""
    p = f"model.layers.{mtp_layer_index(config, depth)}."
    return {p + name: (config.vocab_size, config.hidden_size) for name in MTP_OPTIONAL_TENSORS}


def _shared(own: torch.Tensor | None, model: torch.Tensor) -> torch.Tensor:
    # One comparison at load time keeps a checkpoint's copy of a shared tensor from doubling its memory.
    if own is None or (own.shape == model.shape and bool(torch.equal(own, model))):
        return model
    return own


def mtp_params_from_hf(config: ModelConfig, get: TensorGet, *, dtype: torch.dtype, embed: torch.Tensor,
                       lm_head: torch.Tensor, present: frozenset[str], depth: int = 0,
                       layer: Callable[[ModelConfig, int, TensorGet, torch.dtype], LayerParams] = layer_params
                       ) -> MTPParams:
    """MTP layer `depth` from checkpoint tensors (`get` as `params.checked_fetch` makes it).

    embed, lm_head: the model's [V, D] embedding and head, used unless the checkpoint's own
    differ; present: the optional tensor names the checkpoint holds; layer: builds its decoder
    layer (`layer_params`, or an expert-parallel rank's `expert_parallel_layer`).
    """
    i = mtp_layer_index(config, depth)
    p = f"model.layers.{i}."

    def optional(name: str) -> torch.Tensor | None:
        return get(p + name) if p + name in present else None

    return MTPParams(
        enorm=get(p + "enorm.weight"),
        hnorm=get(p + "hnorm.weight"),
        eh_proj=get(p + "eh_proj.weight"),
        layer=layer(config, i, get, dtype),
        norm=get(p + "shared_head.norm.weight"),
        embed=_shared(optional("embed_tokens.weight"), embed),
        head=_shared(optional("shared_head.head.weight"), lm_head),
    )


def load_mtp(config: ModelConfig, params: Params, fetch: TensorFetch, dtype: torch.dtype,
             device: torch.device | str, present: frozenset[str], *, parallel: Parallel | None = None) -> Any:
    """The first MTP layer of a checkpoint whose model `params` are loaded, as its family loads it; `fetch`
    as for `params_from_hf` (a rank's shard of each tensor under `parallel`); present: the names of the
    tensors the checkpoint holds that loading reads."""
    return mtp_family(config).load(config, params, fetch, dtype, device, present, parallel)


def mla_load_mtp(config: ModelConfig, params: Params, fetch: TensorFetch, dtype: torch.dtype,
                 device: torch.device | str, present: frozenset[str], parallel: Parallel | None) -> MTPParams:
    """V2/V3's first MTP layer (`MTPFamily.load`): under `parallel`'s expert parallelism its MoE block
    holds the rank's own routed experts."""
    layer: Callable[[ModelConfig, int, TensorGet, torch.dtype], LayerParams] = layer_params
    if parallel is not None and parallel.expert_parallel and parallel.tensor_parallel > 1:
        layer = expert_parallel_layer(config, parallel.rank, parallel.tensor_parallel)
    return mtp_params_from_hf(config, checked_fetch(fetch, dtype=dtype, device=device), dtype=dtype,
                              embed=params.embed, lm_head=params.lm_head, present=present, layer=layer)
