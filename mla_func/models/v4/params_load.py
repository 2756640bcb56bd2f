"""Building DeepSeek-V4's params pytree from checkpoint tensors (named as in `params`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from mla_func.checkpoint.files import CheckpointError
from mla_func.core.config import ModelConfig
from mla_func.core.params import Params
from mla_func.core.rope_tables import rope_positions, rope_tables
from mla_func.models.v4.config import CSA, SLIDING, v4_fields
from mla_func.models.v4.params import (CompressorParams, HyperConnectionParams, HyperHeadParams, IndexerParams, V4AttentionParams,
                        V4LayerParams, V4MoEParams, v4_held_dtype)

TensorFetch = Callable[[str], torch.Tensor]


def v4_rope_tables(config: ModelConfig, device: torch.device | str, num_positions: int
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((cos, sin) of the main rope, (cos, sin) of the compress rope), each [num_positions, R / 2] float32."""
    v = v4_fields(config)
    main = rope_tables(config, device, num_positions)
    compress = rope_tables(dataclasses.replace(config, rope=v.compress_rope), device, num_positions)
    return main, compress


def v4_with_max_positions(params: Params, num_positions: int) -> Params:
    """`params` with every RoPE table (the model's and each layer's) covering `num_positions` positions."""
    (cos, sin), (comp_cos, comp_sin) = v4_rope_tables(params.config, params.rope_cos.device, num_positions)
    layers = []
    for layer in params.layers:
        compressed = layer.attn.compressor is not None
        attn = dataclasses.replace(layer.attn, rope_cos=comp_cos if compressed else cos,
                                   rope_sin=comp_sin if compressed else sin)
        layers.append(dataclasses.replace(layer, attn=attn))
    return dataclasses.replace(params, layers=tuple(layers), rope_cos=cos, rope_sin=sin)


def v4_params_from_hf(config: ModelConfig, fetch: TensorFetch, *, dtype: torch.dtype, device: torch.device | str,
                      progress: bool = False, max_model_len: int | None = None) -> Params:
    """The params pytree of a V4 checkpoint; `fetch(name)` returns one tensor checked against its shape.

    Raises CheckpointError naming a tensor that holds NaN or inf once converted, or a
    `tid2eid` entry that names no expert.
    """
    v = v4_fields(config)
    if v is None:
        raise ValueError(f"v4_params_from_hf: expected a deepseek_v4 config, got {config.model_type!r}")

    def get(name: str) -> torch.Tensor:
        tensor = fetch(name).to(device=device, dtype=v4_held_dtype(name, dtype))
        if not bool(torch.isfinite(tensor).all()):  # one sync a tensor, at load time
            raise CheckpointError(f"tensor {name!r} holds NaN or inf values (as {tensor.dtype})")
        return tensor

    def compressor(prefix: str) -> CompressorParams:
        return CompressorParams(position_bias=get(prefix + "ape"), kv_norm=get(prefix + "norm.weight"))

    def input_rows(a: str, kind: str) -> torch.Tensor:
        """The layer's input projections stacked in `V4AttentionParams.input_widths` order."""
        names = [a + "wq_a.weight", a + "wkv.weight"]
        if kind != SLIDING:
            names += [a + "compressor.wkv.weight", a + "compressor.wgate.weight"]
        if kind == CSA:
            names += [a + "indexer.compressor.wkv.weight", a + "indexer.compressor.wgate.weight"]
        return torch.cat([get(name) for name in names])

    def hyper(prefix: str) -> HyperConnectionParams:
        return HyperConnectionParams(fn=get(prefix + "_fn"), base=get(prefix + "_base"), scale=get(prefix + "_scale"))

    def experts(prefix: str, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.cat([get(f"{prefix}{j}.w1.weight"), get(f"{prefix}{j}.w3.weight")]), get(f"{prefix}{j}.w2.weight"))
                for j in range(count)]

    positions = rope_positions(config, max_model_len)
    (main_cos, main_sin), (comp_cos, comp_sin) = v4_rope_tables(config, device, positions)
    layers = []
    num_layers = config.num_hidden_layers
    for i in tqdm(range(num_layers), desc="loading layers", unit="layer", disable=not progress):
        p, kind = f"model.layers.{i}.", v.layer_types[i]
        a = p + "attn."
        cos, sin = (main_cos, main_sin) if kind == SLIDING else (comp_cos, comp_sin)
        indexer = None
        if kind == CSA:
            indexer = IndexerParams(compressor=compressor(a + "indexer.compressor."),
                                    weights_proj=get(a + "indexer.weights_proj.weight"))
        query_rows = [get(a + "wq_b.weight")] + ([get(a + "indexer.wq_b.weight")] if kind == CSA else [])
        attn = V4AttentionParams(
            in_proj=input_rows(a, kind), q_a_norm=get(a + "q_norm.weight"), q_b_proj=torch.cat(query_rows),
            kv_norm=get(a + "norm.weight"), o_a_proj=get(a + "wo_a.weight"),
            o_b_proj=get(a + "wo_b.weight"), sinks=get(a + "attn_sink"), rope_cos=cos, rope_sin=sin,
            compressor=None if kind == SLIDING else compressor(a + "compressor."), indexer=indexer,
        )
        f = p + "ffn."
        stacked = experts(f + "experts.", config.n_routed_experts or 0)
        if config.n_shared_experts:
            shared = f + "shared_experts."
            stacked.append((torch.cat([get(shared + "w1.weight"), get(shared + "w3.weight")]), get(shared + "w2.weight")))
        hashed = v.mlp_layer_types[i] == "hash_moe"
        mlp = V4MoEParams(
            gate=get(f + "gate.weight"),
            w13=torch.stack([w13 for w13, _ in stacked]), w2=torch.stack([w2 for _, w2 in stacked]),
            e_score_correction_bias=None if hashed else get(f + "gate.bias"),
            tid2eid=_tid2eid(fetch(f + "gate.tid2eid"), f + "gate.tid2eid", config, device) if hashed else None,
        )
        del stacked
        head = None
        if i == num_layers - 1:
            head = HyperHeadParams(fn=get("model.hc_head.hc_fn"), base=get("model.hc_head.hc_base"),
                                   scale=get("model.hc_head.hc_scale"))
        layers.append(V4LayerParams(attn_norm=get(p + "attn_norm.weight"), attn=attn, ffn_norm=get(p + "ffn_norm.weight"),
                                    mlp=mlp, attn_hc=hyper(p + "hc_attn"), ffn_hc=hyper(p + "hc_ffn"), hc_head=head))
    embed = get("model.embed_tokens.weight")
    return Params(embed=embed, layers=tuple(layers), norm=get("model.norm.weight"),
                  lm_head=embed if config.tie_word_embeddings else get("head.weight"),
                  rope_cos=main_cos, rope_sin=main_sin, config=config)


def _tid2eid(table: torch.Tensor, name: str, config: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """The hash-routing table as int64 expert ids, each checked to name an expert."""
    if table.dtype.is_floating_point or table.dtype == torch.bool:
        raise CheckpointError(f"tensor {name!r}: expected integer expert ids, got {table.dtype}")
    ids = table.to(device=device, dtype=torch.int64)
    experts = config.n_routed_experts or 0
    if bool(((ids < 0) | (ids >= experts)).any()):
        raise CheckpointError(f"tensor {name!r}: expert ids must be in [0, n_routed_experts={experts})")
    return ids
