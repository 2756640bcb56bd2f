"""The pure forward: logits, state = forward(params, state, batch, mode).

The forward composes the layers' own functions (see `layers`): embed, then for
each layer its kind's `enter` and `body` over that layer's params and cache, then
the final norm and the logits rows. Per-step facts the layers share are made once
before the first layer (`LayerContext`; every row's own view, `rows.row_metadata`,
when `rows.rows_needed` says a layer reads it). `prefill` and `decode` are the same
function restricted to one segment kind; `forward` accepts any kind, mixed included,
where prefill rows and decode rows share every projection and differ only in the
attention path each segment takes (each with its own metadata).

`forward_outputs` is the same function returning a `ForwardOutput` pytree: the
logits, and the last hidden states (one per logits row: after the final norm, or
what the last layer hands on in a `layers.FinalResidual`) when asked for, as a
drafter that continues from the model's states needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mla_func.core.batch import Batch, check_batch
from mla_func.core.exchange import row_exchange
from mla_func.core.layers import FinalResidual, LayerContext, LayerKind, layer_kinds
from mla_func.core.mode import ForwardMode, SegmentKind
from mla_func.core.params import Params
from mla_func.core.rows import row_metadata, rows_needed
from mla_func.core.vocab import embed_tokens, whole_logits
from mla_func.kernels import Ops, ops_for, with_collectives
from mla_func.pytree import register_dataclass
from mla_func.state.kv_cache import KVCacheState


@register_dataclass
@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What a forward returns besides the state.

    logits: [mode.padded_num_logits, V] at least float32; rows past mode.num_logits are padding
    hidden: [mode.padded_num_logits, H] the hidden state a drafter continues from of each logits row:
            the normalised last hidden state (H = D), or the last layer's `FinalResidual.hidden`
            (a model with several residual streams: those streams before their final collapse,
            H = streams * D); None when not asked for
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


def _check(name: str, params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode,
           kinds: Sequence[LayerKind], ops: Ops | None) -> Ops:
    state.check_live(name)
    check_batch(batch, mode)
    if not state.num_layers == len(params.layers) == len(kinds):
        raise ValueError(f"{name}: state has {state.num_layers} layer caches, params {len(params.layers)} layers, "
                         f"and {len(kinds)} layer kinds are given")
    embed = params.embed
    if state.device != embed.device or state.dtype != embed.dtype:
        raise ValueError(f"{name}: the state is {state.dtype} on {state.device}, the model {embed.dtype} on "
                         f"{embed.device}: make the state with init_state(model, ...)")
    if mode.block_size and mode.block_size != state.block_size:
        raise ValueError(f"{name}: the batch was planned for blocks of {mode.block_size} tokens, the state's hold "
                         f"{state.block_size}")
    if mode.cache_groups and mode.cache_groups != state.groups:
        raise ValueError(f"{name}: the batch was planned for cache groups {mode.cache_groups}, the state has "
                         f"{state.groups}")
    if mode.batch_invariant and not params.config.family.supports_batch_invariant:
        raise ValueError(f"{name}: batch-invariant steps cover families with batch-invariant ops; "
                         f"{params.config.family.title}'s layers "
                         "have no batch-invariant ops yet (decide the step with batch_invariant=False)")
    if ops is None:
        return with_collectives(ops_for(mode.backend, mode.batch_invariant, mode.w8a8), params.collectives)
    if ops.collectives is not params.collectives:
        # A sharded layer's partial sums would reach the next layer unsummed: refused, never run.
        raise ValueError(f"{name}: the ops' collectives span {ops.collectives.size} rank(s), the params are a "
                         f"shard over {params.collectives.size} (bind the table with "
                         "with_collectives(ops, params.collectives))")
    if ops.backend != mode.backend:
        raise ValueError(f"{name}: ops are for backend {ops.backend!r}, the mode for {mode.backend!r}")
    if ops.batch_invariant != mode.batch_invariant:
        raise ValueError(f"{name}: ops are {'' if ops.batch_invariant else 'not '}batch-invariant, the mode is "
                         f"{'' if mode.batch_invariant else 'not '}(give ops_for(backend, batch_invariant="
                         f"{mode.batch_invariant}) or leave ops unset)")
    if ops.w8a8 != mode.w8a8:
        raise ValueError(f"{name}: ops {'quantize' if ops.w8a8 else 'do not quantize'} FP8 products' activations "
                         f"(w8a8), the mode {'does' if mode.w8a8 else 'does not'} (give ops_for(backend, w8a8="
                         f"{mode.w8a8}) or leave ops unset)")
    return ops


def _run(name: str, params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode, *, copy: bool,
         ops: Ops | None, layers: Sequence[LayerKind] | None, return_hidden: bool) -> tuple[ForwardOutput, KVCacheState]:
    config = params.config
    kinds = layer_kinds(config) if layers is None else tuple(layers)
    ops = _check(name, params, state, batch, mode, kinds, ops)
    valid = batch.real_rows()
    ctx = LayerContext(batch=batch, mode=mode, config=config, ops=ops, rope_cos=params.rope_cos,
                       rope_sin=params.rope_sin, valid=valid, inplace=not copy,
                       # Every rank's real rows and token ids, gathered once here for all layers' exchanges.
                       exchange=row_exchange(batch.input_ids, valid, mode, ops.collectives),
                       # Every row's own key count and block tables, made once here for all layers (on the device,
                       # so a captured graph makes it too and replays copy nothing more in).
                       rows=row_metadata(batch, mode) if rows_needed(config, mode) else None)
    # A vocab-parallel rank holds V / n rows of the embedding and the LM head (`core.vocab`).
    delta = embed_tokens(batch.input_ids, params.embed, config.vocab_size, ops.collectives)   # [T, D]
    residual: torch.Tensor | FinalResidual | None = None
    caches = []
    for kind, p, cache in zip(kinds, params.layers, state.layers):
        entered, residual = kind.enter(p, delta, residual, ctx)
        delta, residual, cache = kind.body(p, entered, residual, cache, ctx)
        caches.append(cache)
    carried = None
    if isinstance(residual, FinalResidual):
        carried = residual.hidden
        residual = residual.residual
    x, _ = ops.dense.rms_norm(delta, params.norm, config.rms_norm_eps, residual=residual)
    if mode.gather_logits:
        x = x[batch.logits_indices]
    hidden = None
    if return_hidden:
        # A last layer's own hidden state is gathered only here: a step without a drafter copies none of it.
        hidden = x if carried is None else carried[batch.logits_indices] if mode.gather_logits else carried
    logits = whole_logits(ops.dense.logits(x, params.lm_head), config.vocab_size, ops.collectives)  # [N, V] float32+
    new_state = replace(state, layers=tuple(caches))
    if not copy:
        state.donate(name)
    return ForwardOutput(logits, hidden), new_state


def forward_outputs(params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode, *, copy: bool = False,
                    ops: Ops | None = None, layers: Sequence[LayerKind] | None = None,
                    return_hidden: bool = True) -> tuple[ForwardOutput, KVCacheState]:
    """`forward`, returning the `ForwardOutput` pytree (logits, and hidden states when `return_hidden`)."""
    return _run("forward", params, state, batch, mode, copy=copy, ops=ops, layers=layers, return_hidden=return_hidden)


def forward(
    params: Params,
    state: KVCacheState,
    batch: Batch,
    mode: ForwardMode,
    *,
    copy: bool = False,
    ops: Ops | None = None,
    layers: Sequence[LayerKind] | None = None,
) -> tuple[torch.Tensor, KVCacheState]:
    """Run one step of any kind.

    returns logits [mode.padded_num_logits, V] (at least float32; rows past
            mode.num_logits belong to padding) and the new state.
    copy:   write the cache out of place and keep `state` valid; otherwise `state`
            is donated and using it again raises.
    ops:    the op table to call, by default `ops_for(mode.backend, mode.batch_invariant, mode.w8a8)` bound to
            `params.collectives` (the ranks a sharded model spans); an explicit
            table (e.g. `record_expert_choice`) instruments or replaces ops
            without touching any module.
    layers: the kind of each layer (see `layers.LayerKind`), by default
            `layer_kinds(params.config)`; params.layers and state.layers follow it.
    """
    out, new_state = _run("forward", params, state, batch, mode, copy=copy, ops=ops, layers=layers,
                          return_hidden=False)
    return out.logits, new_state


def _segment(name: str, kind: SegmentKind, params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode,
             copy: bool, ops: Ops | None) -> tuple[torch.Tensor, KVCacheState]:
    if mode.kind is not kind:
        raise ValueError(f"{name}: expected a {kind.value} mode, got kind {mode.kind.value!r}")
    out, new_state = _run(name, params, state, batch, mode, copy=copy, ops=ops, layers=None, return_hidden=False)
    return out.logits, new_state


def prefill(params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode, *,
            copy: bool = False, ops: Ops | None = None) -> tuple[torch.Tensor, KVCacheState]:
    """`forward` for a step whose every row is a prefill row (mode.kind is PREFILL)."""
    return _segment("prefill", SegmentKind.PREFILL, params, state, batch, mode, copy, ops)


def decode(params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode, *,
           copy: bool = False, ops: Ops | None = None) -> tuple[torch.Tensor, KVCacheState]:
    """`forward` for a step whose every row is a decode row (mode.kind is DECODE)."""
    return _segment("decode", SegmentKind.DECODE, params, state, batch, mode, copy, ops)
