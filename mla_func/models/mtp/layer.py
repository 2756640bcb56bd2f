"""The MTP drafter: DeepSeek-V3's multi-token-prediction layer as one more layer kind of the same forward.

For the token t at position i and the hidden state h the target model left at
position i - 1 (after its final norm), an MTP layer computes (DeepSeek-V3, sec. 2.2)

    x      = eh_proj [enorm(embed(t)); hnorm(h)]        # [T, 2D] -> [T, D]
    y      = DecoderLayer(x)                            # MLA over the drafter's own cache, MLP or MoE
    g      = norm(y)                                    # shared_head.norm
    logits = head(g)                                    # the token at position i + 1

so the drafter is `forward_outputs` over params whose one layer is the MTP layer
(`drafter_params`), whose one layer kind is `MTPLayer` (its `enter` makes x from the
embedding and `batch.hidden`, then enters the decoder layer as any layer does), and
whose state is a `KVCacheState` of one cache in the target's block geometry
(`init_drafter_state`): the target's block tables address it unchanged. The drafter's
output hidden state g is what a further draft continues from (the one MTP layer applied
k times, each time on its own previous output, as serving engines run DeepSeek's MTP).

That is V2/V3's MTP layer (`mla_mtp` makes its family's `MTPFamily`). `mtp_layer`, `drafter_params`
and `drafter_hidden_size` serve every family: each asks the model's `Family.mtp`, so a family whose
MTP layer differs (DeepSeek-V4's, `models.v4.mtp`) brings its own kind, params and hidden width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from mla_func.core.batch import Batch, BatchError
from mla_func.core.config import ModelConfig
from mla_func.core.family import MTPFamily
from mla_func.core.forward import ForwardOutput, forward_outputs
from mla_func.core.layers import LayerContext, LayerKind
from mla_func.core.mode import ForwardMode
from mla_func.core.model import Model
from mla_func.core.params import Params
from mla_func.core.prepare import init_state
from mla_func.models.mtp.params import (MTPParams, mla_load_mtp, mla_mtp_optional_shapes, mla_mtp_tensor_shapes,
                                        mtp_family, mtp_layer_index)
from mla_func.state.kv_cache import KVCacheState
from mla_func.state.layer_cache import CacheGroup

__all__ = ["MTPLayer", "DrafterFn", "drafter_hidden_size", "drafter_params", "init_drafter_state", "mla_mtp",
           "mtp_layer", "target_step_fn"]


@dataclass(frozen=True, slots=True)
class MTPLayer:
    """The layer kind of an MTP layer: the fusion of embedding and hidden state, then `base`'s layer."""

    base: LayerKind
    name: str = "mtp"

    def init_cache(self, config: ModelConfig, groups: tuple[CacheGroup, ...], *, dtype: torch.dtype,
                   device: torch.device | str) -> Any:
        return self.base.init_cache(config, groups, dtype=dtype, device=device)

    def lookback(self, config: ModelConfig) -> int | None:
        return self.base.lookback(config)

    def enter(self, p: MTPParams, delta: torch.Tensor, residual: torch.Tensor | None,
              ctx: LayerContext) -> tuple[Any, torch.Tensor]:
        """delta [T, D] the rows' token embeddings (the first layer) -> what `base` enters with for x [T, D]."""
        if residual is not None:
            raise ValueError("MTPLayer.enter: an MTP layer is the first layer of a drafter (residual must be None)")
        hidden = ctx.batch.hidden
        if hidden is None:
            raise BatchError("hidden: a drafter step needs the hidden state each row continues from (batch.hidden)")
        eps, dense = ctx.config.rms_norm_eps, ctx.ops.dense
        fused = torch.cat([dense.rms_norm(delta, p.enorm, eps), dense.rms_norm(hidden.to(delta.dtype), p.hnorm, eps)],
                          dim=-1)                                                          # [T, 2D]
        return self.base.enter(p.layer, dense.linear(fused, p.eh_proj), None, ctx)

    def body(self, p: MTPParams, entered: Any, residual: torch.Tensor, cache: Any,
             ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return self.base.body(p.layer, entered, residual, cache, ctx)


def mtp_layer(config: ModelConfig) -> LayerKind:
    """The layer kind of a model's MTP layer as a drafter runs it (`MTPFamily.layer_kind`).
    ValueError for a family whose MTP layers are not run."""
    if config.family.mtp is None:
        raise ValueError(f"mtp_layer: {config.family.title} multi-token-prediction (MTP) layers are not supported")
    return config.family.mtp.layer_kind(config)


def drafter_params(model: Model) -> Params:
    """The params pytree of the drafter: the model's MTP layer as the one layer, its norm and head as the
    final norm and head (`MTPFamily.drafter_params`). Raises ValueError if the model has no MTP layer."""
    if model.mtp is None:
        raise ValueError("speculative decoding needs the model's MTP layer: load it with load_model(..., mtp=True)")
    return mtp_family(model.config).drafter_params(model)


def drafter_hidden_size(config: ModelConfig) -> int:
    """H: the width of the hidden states [T, H] the model's steps hand its drafter (`MTPFamily.hidden_size`)."""
    return mtp_family(config).hidden_size(config)


def _mla_drafter_params(model: Model) -> Params:
    mtp = model.mtp
    # Params.layers holds each layer's params of its kind; this kind's are MTPParams.
    layers = cast(tuple[Any, ...], (mtp,))
    # A sharded model's drafter is sharded alike (`load_mtp`): it joins its partial sums over the same ranks.
    return Params(embed=mtp.embed, layers=layers, norm=mtp.norm, lm_head=mtp.head, rope_cos=model.params.rope_cos,
                  rope_sin=model.params.rope_sin, config=model.config, collectives=model.params.collectives)


def _mla_prefix(config: ModelConfig) -> str:
    return f"model.layers.{mtp_layer_index(config)}."


def _hidden_size(config: ModelConfig) -> int:
    return config.hidden_size


def mla_mtp(base: LayerKind) -> MTPFamily:
    """The `MTPFamily` of V2/V3's MTP layer (`model.layers.{L}.`, `models.mtp.params`), whose decoder layer
    is of kind `base`: it drafts from the target's normalised hidden state [T, D]."""
    kind = MTPLayer(base)

    def layer_kind(config: ModelConfig) -> MTPLayer:
        return kind

    return MTPFamily(layer_kind=layer_kind, prefix=_mla_prefix, tensor_shapes=mla_mtp_tensor_shapes,
                     optional_shapes=mla_mtp_optional_shapes, load=mla_load_mtp, drafter_params=_mla_drafter_params,
                     hidden_size=_hidden_size)


def init_drafter_state(model: Model, target: KVCacheState) -> KVCacheState:
    """The drafter's state: one zeroed cache of the MTP layer's kind in `target`'s block geometry (its
    groups as they are, so the target's tables address it). ValueError if the MTP layer reads group 0
    further back than the target's lookback: the scheduler frees the target's blocks behind it."""
    kind = mtp_layer(model.config)
    lookback, target_lookback = kind.lookback(model.config), target.groups[0].lookback
    if target_lookback is not None and (lookback is None or lookback > target_lookback):
        raise ValueError(f"init_drafter_state: the MTP layer reads cache group 0 back {lookback} tokens (None: every "
                         f"token), past the target's lookback of {target_lookback}")
    cache = kind.init_cache(model.config, target.groups, dtype=target.dtype, device=target.device)
    return KVCacheState.checked([cache], groups=target.groups)


@dataclass(frozen=True, slots=True)
class DrafterFn:
    """The drafter as a step function for `make_step`: (ForwardOutput(logits, hidden), state)."""

    kind: LayerKind

    def __call__(self, params: Params, state: KVCacheState, batch: Batch,
                 mode: ForwardMode) -> tuple[ForwardOutput, KVCacheState]:
        return forward_outputs(params, state, batch, mode, layers=(self.kind,), return_hidden=True)


def target_step_fn(params: Params, state: KVCacheState, batch: Batch,
                   mode: ForwardMode) -> tuple[ForwardOutput, KVCacheState]:
    """The model's forward as a step function that also returns the hidden state of each logits row,
    which the drafter continues from."""
    return forward_outputs(params, state, batch, mode, return_hidden=True)


def drafter_bytes_per_block(model: Model, block_size: int) -> int:
    """Bytes one block of the drafter's cache costs, in the model's dtype (measured on the meta device)."""
    probe = init_state(model, num_blocks=2, block_size=block_size, device="meta", layers=(mtp_layer(model.config),))
    return probe.bytes_per_block(0)
