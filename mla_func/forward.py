"""The pure forward: logits, state = forward(params, state, batch, mode).

`prefill` and `decode` are the same function restricted to one segment kind;
`forward` accepts any kind, mixed included, where prefill rows and decode rows
share every projection and differ only in the attention path each segment takes
(each with its own metadata).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import mla_attention
from .batch import Batch, check_batch
from .kernels import Ops, ops_for
from .mode import ForwardMode
from .moe import feed_forward
from .params import Params
from .state.kv_cache import KVCacheState


def _run(
    name: str,
    params: Params,
    state: KVCacheState,
    batch: Batch,
    mode: ForwardMode,
    copy: bool,
    ops: Ops | None,
) -> tuple[torch.Tensor, KVCacheState]:
    state.check_live(name)
    check_batch(batch, mode)
    config = params.config
    if state.num_layers != config.num_hidden_layers:
        raise ValueError(f"{name}: state has {state.num_layers} layers, the model {config.num_hidden_layers}")
    if ops is None:
        ops = ops_for(mode.backend)
    elif ops.backend != mode.backend:
        raise ValueError(f"{name}: ops are for backend {ops.backend!r}, the mode for {mode.backend!r}")
    eps = config.rms_norm_eps
    valid = batch.slot_mapping >= 0                                     # real rows always write a slot

    layers = params.layers
    hidden = F.embedding(batch.input_ids, params.embed)                 # [T, D]
    # Each layer's input norm runs with its first projection (one launch at decode sizes).
    qkv_a = ops.dense.rms_norm_linear(hidden, layers[0].input_norm, eps, layers[0].attn.qkv_a_proj)
    caches = []
    for i, layer in enumerate(layers):
        attn_out, cache = mla_attention(
            layer.attn, qkv_a, state.kv_cache[i], batch, mode, config, ops,
            params.rope_cos, params.rope_sin, inplace=not copy,
        )
        caches.append(cache)
        x, hidden = ops.dense.rms_norm(attn_out, layer.post_attention_norm, eps, residual=hidden)
        ffn_out = feed_forward(layer.mlp, x, valid, config, ops)
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            qkv_a, hidden = ops.dense.rms_norm_linear(ffn_out, nxt.input_norm, eps, nxt.attn.qkv_a_proj, residual=hidden)
    x, hidden = ops.dense.rms_norm(ffn_out, params.norm, eps, residual=hidden)
    # A decode step's rows are its logits rows in order (padding rows give padding logits).
    if mode.kind != "decode" or x.shape[0] != mode.padded_num_logits:
        x = x[batch.logits_indices]
    logits = ops.dense.linear(x, params.lm_head)                              # [N, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    new_state = state.with_caches(tuple(caches))
    if not copy:
        state.donate(name)
    return logits, new_state


def forward(
    params: Params,
    state: KVCacheState,
    batch: Batch,
    mode: ForwardMode,
    *,
    copy: bool = False,
    ops: Ops | None = None,
) -> tuple[torch.Tensor, KVCacheState]:
    """Run one step of any kind.

    returns logits [mode.padded_num_logits, V] (at least float32; rows past
            mode.num_logits belong to padding) and the new state.
    copy:   write the cache out of place and keep `state` valid; otherwise `state`
            is donated and using it again raises.
    ops:    the op table to call, by default `ops_for(mode.backend)`; an explicit
            table (e.g. `record_expert_choice`) instruments or replaces ops
            without touching any module.
    """
    return _run("forward", params, state, batch, mode, copy, ops)


def prefill(params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode, *,
            copy: bool = False, ops: Ops | None = None):
    """`forward` for a step whose every row is a prefill row (mode.kind == "prefill")."""
    if mode.kind != "prefill":
        raise ValueError(f"prefill: expected a prefill mode, got kind {mode.kind!r}")
    return _run("prefill", params, state, batch, mode, copy, ops)


def decode(params: Params, state: KVCacheState, batch: Batch, mode: ForwardMode, *,
           copy: bool = False, ops: Ops | None = None):
    """`forward` for a step whose every row is a decode row (mode.kind == "decode")."""
    if mode.kind != "decode":
        raise ValueError(f"decode: expected a decode mode, got kind {mode.kind!r}")
    return _run("decode", params, state, batch, mode, copy, ops)
