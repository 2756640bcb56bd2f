"""DeepSeek-V4's released checkpoint layout, written here independently of mla-func's loader.

`write_v4_official(src, official, dequantized, expert_dtype)` reads a float V4 checkpoint that
transformers saved and writes it twice:

* `official`: as DeepSeek ships V4 -- DeepSeek's own tensor names (`embed.weight`, `layers.N.`,
  `attn.kv_norm.weight`, `hc_head_fn`), the attention's and indexer's query projections, `wkv`,
  `wo_a`, `wo_b` and the shared expert as float8_e4m3fn with a float8_e8m0fnu `.scale` per
  128 x 128 block (the power of two at or above the block's largest magnitude / 448), the routed
  experts as e2m1 pairs packed into int8 [N, K / 2] (even column in the low nibble) with a
  float8_e8m0fnu `.scale` per 32 values of a row (the power of two at or above the block's largest
  magnitude / 6) when expert_dtype is "fp4" (FP8 as the linears when "fp8"), the compressors'
  projections and everything else unquantized (bfloat16, float32 where DeepSeek keeps it), and
  config.json's released `quantization_config` and `expert_dtype`;
* `dequantized`: the transformers-saved checkpoint with each quantized weight replaced by its
  dequantized float32 values and every other tensor as stored in `official`: the oracle's weights.

With `config_spelling="released"`, `official`'s config.json is also written as DeepSeek ships it
(`released_config`): DeepSeek-V4-Flash's fields and nesting, `compress_ratios`, `num_hash_layers`,
`rope_scaling`, `qk_rope_head_dim` in place of transformers' `layer_types`, `compress_rates`,
`mlp_layer_types`, `rope_parameters`, `partial_rotary_factor`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from support.fp8_official import write_beside

FP8_BLOCK = 128
FP4_GROUP = 32
E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
RELEASED_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
# transformers' saved names of the weights DeepSeek-V4 stores quantized (and of an MTP layer's, `mtp.N.`,
# named as the decoder layers' are).
LINEAR = re.compile(r"^(model\.layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                    r"|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")
ROUTED = re.compile(r"^(model\.layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
FLOAT32 = re.compile(r"(attn_sink|\.ape$|gate\.bias$|hc_)")


def power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0), float32."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (values float8_e4m3fn [N, K], scale float8_e8m0fnu [ceil(N/128), ceil(K/128)], dequantized float32)."""
    n, k = w.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK].float()
            scale = power_of_two_at_least(tile.abs().max().clamp(min=1e-30) / E4M3_MAX)
            scales[i, j] = scale
            values[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = (tile / scale).to(
                torch.float8_e4m3fn)
    full = scales.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return values, scales.to(torch.float8_e8m0fnu), values.float() * full


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> (packed int8 [N, K / 2], scale float8_e8m0fnu [N, K / 32], dequantized float32).

    Each value is rounded to the nearest e2m1 value of (w / scale) (the larger magnitude on a tie), coded as
    sign << 3 | index into E2M1_GRID."""
    n, k = w.shape
    groups = w.float().view(n, k // FP4_GROUP, FP4_GROUP)
    scale = power_of_two_at_least(groups.abs().amax(dim=-1).clamp(min=1e-30) / E2M1_GRID[-1])     # [N, K / 32]
    scaled = groups / scale[..., None]
    grid = torch.tensor(E2M1_GRID)
    distance = (scaled.abs()[..., None] - grid).abs()                                             # [N, G, 32, 8]
    # The last index of the smallest distance: ties round away from zero.
    index = (distance.shape[-1] - 1) - distance.flip(-1).argmin(dim=-1)
    codes = (index | ((scaled < 0).long() << 3)).view(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    signs = torch.where(codes >= 8, -1.0, 1.0)
    dequantized = (signs * grid[codes & 7]).view(n, k // FP4_GROUP, FP4_GROUP) * scale[..., None]
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu), dequantized.view(n, k)


def deepseek_name(saved: str) -> str:
    """A transformers-saved V4 tensor name (or an MTP layer's, as `mla_func` names it) as DeepSeek's files name it."""
    tops = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
            "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
            "model.hc_head.hc_scale": "hc_head_scale"}
    if saved in tops:
        return tops[saved]
    name = saved.removeprefix("model.")
    name = re.sub(r"^(mtp\.\d+)\.hc_head\.hc_(fn|base|scale)$", r"\1.hc_head_\2", name)
    return re.sub(r"^((layers|mtp)\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


def stored_plain(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An unquantized tensor as DeepSeek stores it: float32 where it keeps it, integers as they are, else bfloat16."""
    if not tensor.dtype.is_floating_point:
        return tensor
    return tensor.float() if FLOAT32.search(name) else tensor.to(torch.bfloat16)


# DeepSeek-V4-Flash's config.json fields, in its order (its `quantization_config` and `rope_scaling` nested as
# RELEASED_QUANTIZATION_CONFIG and `released_config` write them).
RELEASED_CONFIG_FIELDS = (
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "expert_dtype", "hc_eps",
    "hc_mult", "hc_sinkhorn_iters", "head_dim", "hidden_act", "hidden_size", "index_head_dim", "index_n_heads",
    "index_topk", "initializer_range", "max_position_embeddings", "model_type", "moe_intermediate_size",
    "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
    "num_hidden_layers", "num_hash_layers", "num_key_value_heads", "num_nextn_predict_layers", "o_groups",
    "o_lora_rank", "q_lora_rank", "qk_rope_head_dim", "quantization_config", "rms_norm_eps", "rope_scaling",
    "rope_theta", "routed_scaling_factor", "scoring_func", "sliding_window", "swiglu_limit", "tie_word_embeddings",
    "topk_method", "torch_dtype", "transformers_version", "use_cache", "vocab_size", "compress_rope_theta",
    "compress_ratios",
)
# Released field -> its value where transformers' saved config has no field of that name.
RELEASED_CONSTANTS = {"architectures": ["DeepseekV4ForCausalLM"], "topk_method": "noaux_tc",
                      "torch_dtype": "bfloat16", "transformers_version": "4.57.1"}
# compress_ratios' value of each layer type: DeepSeek's layers pool 4 (CSA) or 128 (HCA) tokens an entry.
RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def released_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A transformers-saved deepseek_v4 config.json dict as DeepSeek's released config.json spells it.

    layer_types -> compress_ratios (0 / 4 / 128 a layer, then 0 for each MTP layer); mlp_layer_types ->
    num_hash_layers; rope_parameters.main -> rope_theta; rope_parameters.compress -> compress_rope_theta and
    rope_scaling (`type`, not `rope_type`, and no attention_factor); the partial rotary factor ->
    qk_rope_head_dim. ValueError where the released spelling cannot say the config's facts: compress rates
    other than 4 and 128, hash layers not all first, a compress rope with an attention_factor other than 1.
    """
    if saved["compress_rates"] != {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}:
        raise ValueError(f"compress_rates {saved['compress_rates']} has no compress_ratios spelling")
    mlp = saved["mlp_layer_types"]
    hashed = mlp.count("hash_moe")
    if mlp != ["hash_moe"] * hashed + ["moe"] * (len(mlp) - hashed):
        raise ValueError(f"mlp_layer_types {mlp} is not a number of hash layers then score layers")
    main, compress = saved["rope_parameters"]["main"], saved["rope_parameters"]["compress"]
    if compress.get("attention_factor", 1.0) != 1.0:
        raise ValueError(f"the compress rope's attention_factor {compress['attention_factor']} has no released spelling")
    scaling = {key: value for key, value in compress.items()
               if key not in ("rope_type", "type", "rope_theta", "partial_rotary_factor", "attention_factor")}
    spelled = {
        **RELEASED_CONSTANTS,
        "compress_ratios": [RATIOS[kind] for kind in saved["layer_types"]] + [0] * saved["num_nextn_predict_layers"],
        "num_hash_layers": hashed,
        "rope_theta": main["rope_theta"],
        "compress_rope_theta": compress["rope_theta"],
        "rope_scaling": {**scaling, "type": compress["rope_type"]},
        "qk_rope_head_dim": int(saved["head_dim"] * main["partial_rotary_factor"]),
    }
    return {name: spelled[name] if name in spelled else saved[name] for name in RELEASED_CONFIG_FIELDS
            if name in spelled or name in saved}


def write_v4_official(src: Path, official: Path, dequantized: Path, expert_dtype: str = "fp4",
                      config_spelling: str = "transformers") -> dict[str, str]:
    """Write both folders (see the module docstring); returns each quantized weight's saved name -> "fp8" / "fp4".

    config_spelling: "transformers" (src's config.json with the released quantization fields) or "released"
    (`released_config` of that)."""
    if config_spelling not in ("transformers", "released"):
        raise ValueError(f"config_spelling: expected 'transformers' or 'released', got {config_spelling!r}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    stored: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    for name, tensor in tensors.items():
        raw = deepseek_name(name)
        fp4 = expert_dtype == "fp4" and ROUTED.match(name)
        if fp4 or LINEAR.match(name) or ROUTED.match(name):
            values, scale, dense[name] = fp4_rows(tensor) if fp4 else fp8_blocks(tensor)
            stored[raw], stored[raw.removesuffix(".weight") + ".scale"] = values, scale
            formats[name] = "fp4" if fp4 else "fp8"
        else:
            stored[raw] = dense[name] = stored_plain(name, tensor)
    write_beside(src, official, stored, {"quantization_config": RELEASED_QUANTIZATION_CONFIG,
                                         "expert_dtype": expert_dtype})
    write_beside(src, dequantized, dense, {})
    if config_spelling == "released":
        config = official / "config.json"
        config.write_text(json.dumps(released_config(json.loads(config.read_text())), indent=2))
    return formats
