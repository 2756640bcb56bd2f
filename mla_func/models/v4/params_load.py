"""Building DeepSeek-V4's params pytree from checkpoint tensors (named as in `params`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mla_func.checkpoint.files import CheckpointError
from mla_func.core.config import ModelConfig
from mla_func.core.params import Params, TensorFetch
from mla_func.kernels.quantized import Weight, cat_rows, dequantized, stack_experts
from mla_func.core.rope_tables import rope_positions, rope_tables
from mla_func.models.v4.config import CSA, SLIDING, v4_fields
from mla_func.models.v4.params import (CompressorParams, HyperConnectionParams, HyperHeadParams, IndexerParams, V4AttentionParams,
                        V4LayerParams, V4MoEParams, v4_held_dtype)



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
                      progress: bool = False, max_model_len: int | None = None, routed: range | None = None) -> Params:
    """The params pytree of a V4 checkpoint; `fetch(name)` returns one tensor checked against its shape,
    or for a weight the checkpoint stores quantized, its FP8 or FP4 pair (`checkpoint.quant_layout`).

    Quantized projections stay pairs, except those read other than by a product (`wo_a`, read per
    group) or joined with unquantized rows into one product (`wq_a` and `wkv` beside a compressor's
    BF16 projections), which are dequantized into `dtype`. Raises CheckpointError naming a tensor that
    holds NaN or inf once converted, or a `tid2eid` entry that names no expert.

    routed: the routed experts to read (default all). Given, each MoE block's w13 / w2 hold those only
    and the shared experts are held apart (`shared_w13`), for `expert_shard` to make an expert-parallel
    rank's share of it.
    """
    v = v4_fields(config)
    if v is None:
        raise ValueError(f"v4_params_from_hf: expected a deepseek_v4 config, got {config.model_type!r}")
    read = V4Reader(config, fetch, dtype, device)
    positions = rope_positions(config, max_model_len)
    main, compress = v4_rope_tables(config, device, positions)
    layers = []
    num_layers = config.num_hidden_layers
    for i in tqdm(range(num_layers), desc="loading layers", unit="layer", disable=not progress):
        kind = v.layer_types[i]
        head = read.hyper_head("model.hc_head.") if i == num_layers - 1 else None
        layers.append(read.layer(f"model.layers.{i}.", kind, v.mlp_layer_types[i],
                                 main if kind == SLIDING else compress, routed=routed, head=head))
    embed = read.get("model.embed_tokens.weight")
    return Params(embed=embed, layers=tuple(layers), norm=read.get("model.norm.weight"),
                  lm_head=embed if config.tie_word_embeddings else read.get("head.weight"),
                  rope_cos=main[0], rope_sin=main[1], config=config)


@dataclass(frozen=True, slots=True)
class V4Reader:
    """Reads V4 params from checkpoint tensors (named as in `params`): `fetch(name)` returns one tensor
    checked against its shape, or a quantized weight's pair; each tensor is moved to `device` in the
    dtype the params hold it in (`v4_held_dtype`) and checked finite (CheckpointError naming it)."""

    config: ModelConfig
    fetch: TensorFetch
    dtype: torch.dtype
    device: torch.device | str

    def plain(self, name: str) -> torch.Tensor:
        value = self.fetch(name)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"tensor {name!r} is stored quantized, but the model holds it as a plain tensor")
        return value

    @staticmethod
    def checked(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(tensor).all()):  # one sync a tensor, at load time
            raise CheckpointError(f"tensor {name!r} holds NaN or inf values (as {tensor.dtype})")
        return tensor

    def get(self, name: str) -> torch.Tensor:
        return self.checked(name, self.plain(name).to(device=self.device, dtype=v4_held_dtype(name, self.dtype)))

    def weight(self, name: str) -> Weight:
        """A projection: a quantized pair as stored (its scales checked when read), else as `get`."""
        value = self.fetch(name)
        return self.get(name) if isinstance(value, torch.Tensor) else value.to(self.device)

    def dense(self, name: str) -> torch.Tensor:
        value = self.fetch(name)
        if isinstance(value, torch.Tensor):
            return self.get(name)
        return self.checked(name, dequantized(value.to(self.device), self.dtype))

    def hyper_head(self, prefix: str) -> HyperHeadParams:
        """A hyper head: `hc_fn`, `hc_base`, `hc_scale` under `prefix`."""
        return HyperHeadParams(fn=self.get(prefix + "hc_fn"), base=self.get(prefix + "hc_base"),
                               scale=self.get(prefix + "hc_scale"))

    def _compressor(self, prefix: str) -> CompressorParams:
        return CompressorParams(position_bias=self.get(prefix + "ape"), kv_norm=self.get(prefix + "norm.weight"))

    def _input_rows(self, a: str, kind: str) -> Weight:
        """The layer's input projections stacked in `V4AttentionParams.input_widths` order: one pair where
        all are quantized alike (a sliding layer's), else one tensor (a compressor's are stored in BF16)."""
        names = [a + "wq_a.weight", a + "wkv.weight"]
        if kind == SLIDING:
            return cat_rows([self.weight(name) for name in names])
        names += [a + "compressor.wkv.weight", a + "compressor.wgate.weight"]
        if kind == CSA:
            names += [a + "indexer.compressor.wkv.weight", a + "indexer.compressor.wgate.weight"]
        return torch.cat([self.dense(name) for name in names])

    def _hyper(self, prefix: str) -> HyperConnectionParams:
        return HyperConnectionParams(fn=self.get(prefix + "_fn"), base=self.get(prefix + "_base"),
                                     scale=self.get(prefix + "_scale"))

    def _expert(self, prefix: str) -> tuple[Weight, Weight]:
        """(w1 rows then w3 rows [2I, D], w2 [D, I]) of one expert."""
        return (cat_rows([self.weight(prefix + "w1.weight"), self.weight(prefix + "w3.weight")]),
                self.weight(prefix + "w2.weight"))

    def layer(self, p: str, kind: str, mlp_type: str, rope: tuple[torch.Tensor, torch.Tensor], *,
              routed: range | None = None, head: HyperHeadParams | None = None) -> V4LayerParams:
        """The layer whose tensors are named under prefix `p`, of attention type `kind` and MoE type
        `mlp_type`, rotating with `rope` (cos, sin); routed: the routed experts to read (`v4_params_from_hf`);
        head: the hyper head it holds (the last layer's)."""
        config, a = self.config, p + "attn."
        indexer = None
        if kind == CSA:
            indexer = IndexerParams(compressor=self._compressor(a + "indexer.compressor."),
                                    weights_proj=self.get(a + "indexer.weights_proj.weight"))
        query_rows = [self.weight(a + "wq_b.weight")] + ([self.weight(a + "indexer.wq_b.weight")] if kind == CSA else [])
        attn = V4AttentionParams(
            in_proj=self._input_rows(a, kind), q_a_norm=self.get(a + "q_norm.weight"), q_b_proj=cat_rows(query_rows),
            kv_norm=self.get(a + "norm.weight"), o_a_proj=self.dense(a + "wo_a.weight"),
            o_b_proj=self.weight(a + "wo_b.weight"), sinks=self.get(a + "attn_sink"), rope_cos=rope[0],
            rope_sin=rope[1], compressor=None if kind == SLIDING else self._compressor(a + "compressor."),
            indexer=indexer,
        )
        f = p + "ffn."
        experts = range(config.n_routed_experts or 0) if routed is None else routed
        held = [self._expert(f"{f}experts.{j}.") for j in experts]
        shared = [self._expert(f + "shared_experts.")] if config.n_shared_experts else []
        # One stack (one expert launch) where routed and shared experts are held alike.
        apart = bool(shared) and (routed is not None or type(shared[0][0]) is not type(held[0][0]))
        w13, w2 = _stacked(held if apart else held + shared)
        shared_w13, shared_w2 = _stacked(shared) if apart else (None, None)
        hashed = mlp_type == "hash_moe"
        mlp = V4MoEParams(
            gate=self.get(f + "gate.weight"), w13=w13, w2=w2,
            e_score_correction_bias=None if hashed else self.get(f + "gate.bias"),
            tid2eid=_tid2eid(self.plain(f + "gate.tid2eid"), f + "gate.tid2eid", config, self.device) if hashed else None,
            shared_w13=shared_w13, shared_w2=shared_w2,
        )
        return V4LayerParams(attn_norm=self.get(p + "attn_norm.weight"), attn=attn, ffn_norm=self.get(p + "ffn_norm.weight"),
                             mlp=mlp, attn_hc=self._hyper(p + "hc_attn"), ffn_hc=self._hyper(p + "hc_ffn"), hc_head=head)


def _stacked(experts: list[tuple[Weight, Weight]]) -> tuple[Weight, Weight]:
    return stack_experts([w13 for w13, _ in experts]), stack_experts([w2 for _, w2 in experts])


def _tid2eid(table: torch.Tensor, name: str, config: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """The hash-routing table as int64 expert ids, each checked to name an expert."""
    if table.dtype.is_floating_point or table.dtype == torch.bool:
        raise CheckpointError(f"tensor {name!r}: expected integer expert ids, got {table.dtype}")
    ids = table.to(device=device, dtype=torch.int64)
    experts = config.n_routed_experts or 0
    if bool(((ids < 0) | (ids >= experts)).any()):
        raise CheckpointError(f"tensor {name!r}: expert ids must be in [0, n_routed_experts={experts})")
    return ids
