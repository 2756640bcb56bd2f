"""Writing a params pytree back out as a Hugging Face checkpoint folder.

`params_to_hf` is the inverse of `mla_func.models.mla.params.params_from_hf`: it undoes the
two load-time reshapes (per-head `w_uk` / `w_uv` back into `kv_b_proj`, stacked
experts back into one gate/up/down triple per expert) and names every tensor as
`hf_tensor_shapes` does (and an MTP layer's as `models.mtp.params.mtp_tensor_shapes` does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mla_func.core.config import ModelConfig
from mla_func.core.params import Params
from mla_func.kernels.quantized import Weight, dequantized
from mla_func.models.mla.params import LayerParams, MLPParams, MoEParams, join_shared
from mla_func.models.mtp.params import MTPParams, mtp_layer_index, mtp_tensor_shapes
from mla_func.models.tensor_shapes import hf_tensor_shapes


def _dense(w: Weight) -> torch.Tensor:
    """A projection as float weights: FP8 pairs (a quantized preset's) are written dequantized, in float32."""
    return dequantized(w, torch.float32)


def _mlp_to_hf(prefix: str, p: MLPParams) -> dict[str, torch.Tensor]:
    gate, up = _dense(p.gate_up).chunk(2, dim=0)                        # [I, D] each
    return {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up, prefix + "down_proj.weight": _dense(p.down)}


def _layer_to_hf(p: str, layer: LayerParams, c: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of one decoder layer under the prefix `p` ("model.layers.{i}.")."""
    out = {p + "input_layernorm.weight": layer.input_norm,
           p + "post_attention_layernorm.weight": layer.post_attention_norm}
    a, attn = p + "self_attn.", layer.attn
    # An indexer's key and query projections are the last rows of qkv_a_proj and q_b_proj.
    index_k_rows = 0 if layer.indexer is None else layer.indexer.k_norm.shape[0]
    index_q_rows = 0 if layer.indexer is None else layer.indexer.weights_proj.shape[0] * index_k_rows
    qkv_a_proj = _dense(attn.qkv_a_proj)
    qkv_a, index_k = qkv_a_proj.split([qkv_a_proj.shape[0] - index_k_rows, index_k_rows])
    q_a, kv_a = qkv_a.split([qkv_a.shape[0] - c.kv_cache_dim, c.kv_cache_dim])
    if attn.q_b_proj is None:
        out[a + "q_proj.weight"] = q_a
    else:
        out[a + "q_a_proj.weight"] = q_a
        if attn.q_a_norm is None:
            raise ValueError("export: a low-rank query (q_b_proj) needs its norm (q_a_norm)")
        out[a + "q_a_layernorm.weight"] = attn.q_a_norm
        q_b_proj = _dense(attn.q_b_proj)
        q_b, index_q = q_b_proj.split([q_b_proj.shape[0] - index_q_rows, index_q_rows])
        out[a + "q_b_proj.weight"] = q_b
        if layer.indexer is not None:
            i = a + "indexer."
            out.update({i + "wq_b.weight": index_q, i + "wk.weight": index_k, i + "k_norm.weight": layer.indexer.k_norm,
                        i + "k_norm.bias": layer.indexer.k_norm_bias,
                        i + "weights_proj.weight": layer.indexer.weights_proj})
    out[a + "kv_a_proj_with_mqa.weight"] = kv_a
    out[a + "kv_a_layernorm.weight"] = attn.kv_a_norm
    # kv_b_proj rows are per head: Dn key rows then Dv value rows, [H * (Dn + Dv), C].
    out[a + "kv_b_proj.weight"] = torch.cat([_dense(attn.w_uk), _dense(attn.w_uv)], dim=1).flatten(0, 1)
    out[a + "o_proj.weight"] = _dense(attn.o_proj)
    m = p + "mlp."
    if isinstance(layer.mlp, MoEParams):
        moe = layer.mlp
        out[m + "gate.weight"] = moe.gate
        if moe.e_score_correction_bias is not None:
            out[m + "gate.e_score_correction_bias"] = moe.e_score_correction_bias
        experts = [MLPParams(gate_up=moe.w13[j], down=moe.w2[j]) for j in range(moe.w13.shape[0])]
        for j in range(moe.num_routed):
            out.update(_mlp_to_hf(f"{m}experts.{j}.", experts[j]))
        if moe.num_shared:
            out.update(_mlp_to_hf(m + "shared_experts.", join_shared(experts[moe.num_routed:])))
    elif isinstance(layer.mlp, MLPParams):
        out.update(_mlp_to_hf(m, layer.mlp))
    else:  # an expert-parallel rank's share holds some of the experts only
        raise ValueError("params_to_hf: one rank's share of a sharded model is not a checkpoint")
    return out


def params_to_hf(params: Params, mtp: MTPParams | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint of `params.config`, by name (views where possible).

    The result has exactly the names and shapes of `hf_tensor_shapes(params.config)`,
    so `params_from_hf(config, out.__getitem__, ...)` rebuilds equal params. With `mtp`,
    also its MTP layer's, as DeepSeek-V3 names them (`models.mtp.params.mtp_tensor_shapes`); its
    embedding and head are written only where they are not the model's own (a shared
    tensor is read back from the model's, so a copy would only double the file).
    """
    c = params.config
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": params.embed, "model.norm.weight": params.norm}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = params.lm_head
    for i, layer in enumerate(params.layers):
        out.update(_layer_to_hf(f"model.layers.{i}.", layer, c))
    _check_names(hf_tensor_shapes(c), out)
    if mtp is None:
        return out
    p = f"model.layers.{mtp_layer_index(c)}."
    layer = {p + "enorm.weight": mtp.enorm, p + "hnorm.weight": mtp.hnorm, p + "eh_proj.weight": mtp.eh_proj,
             p + "shared_head.norm.weight": mtp.norm, **_layer_to_hf(p, mtp.layer, c)}
    _check_names(mtp_tensor_shapes(c), layer)
    if mtp.embed is not params.embed:
        layer[p + "embed_tokens.weight"] = mtp.embed
    if mtp.head is not params.lm_head:
        layer[p + "shared_head.head.weight"] = mtp.head
    return {**out, **layer}


def _check_names(expected: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]) -> None:
    if set(expected) != set(tensors):
        raise ValueError(
            f"params_to_hf: names differ from the checkpoint's: missing {sorted(set(expected) - set(tensors))}, "
            f"extra {sorted(set(tensors) - set(expected))}"
        )
    wrong = {n: (tuple(t.shape), expected[n]) for n, t in tensors.items() if tuple(t.shape) != expected[n]}
    if wrong:
        raise ValueError(f"params_to_hf: shapes differ from the checkpoint's (got, expected): {wrong}")


def save_checkpoint(
    folder: str | Path,
    params: Params,
    *,
    weight_dtype: torch.dtype = torch.bfloat16,
    tokenizer: Any = None,
    extra_config: dict[str, Any] | None = None,
    mtp: MTPParams | None = None,
) -> Path:
    """Write config.json, model.safetensors (and tokenizer.json when given) into `folder`.

    weight_dtype: storage dtype of the weights. The noaux_tc correction bias stays
                  float32: it only steers the top-k choice, where bf16 rounding
                  would flip near-tied experts.
    extra_config: more config.json fields (e.g. bos_token_id).
    mtp:          the model's MTP layer, written as layer `num_hidden_layers` with
                  `num_nextn_predict_layers: 1` in config.json (DeepSeek-V3's layout).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in params_to_hf(params, mtp).items():
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else weight_dtype
        # safetensors wants each tensor to own contiguous memory (no shared views).
        tensors[name] = t.detach().to(device="cpu", dtype=dtype).contiguous().clone()
    weights = folder / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # the writer makes it owner-only; the file is meant to be shipped and read by anyone
    config = params.config.to_hf_dict()
    config["dtype"] = str(weight_dtype).removeprefix("torch.")
    if mtp is not None:
        config["num_nextn_predict_layers"] = 1
    config.update(extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))
    return folder
