"""DeepSeek-V4's released checkpoint layout: FP8 linears with `.scale` siblings, FP4 routed experts.

As DeepSeek-V4(-Flash, -Pro) ship (their model.safetensors.index.json and inference code):

* config.json's `quantization_config` is the block-scaled FP8 one (`quant_method: fp8`, `fmt: e4m3`,
  `weight_block_size: [128, 128]`, `activation_scheme: dynamic`, `scale_fmt: ue8m0`), and
  `expert_dtype` (top level, or inside `quantization_config` as transformers moves it) says how the
  routed experts are stored: "fp4" (the released instruct models; assumed when absent, as V4-Pro's
  config.json omits it) or "fp8";
* the attention's `wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, the indexer's `wq_b`, the shared expert's
  `w1`, `w2`, `w3` (and the MTP layer's `e_proj`, `h_proj`) are float8_e4m3fn, each with a `.scale`
  beside `.weight` ([ceil(N / 128), ceil(K / 128)], float8_e8m0fnu with `scale_fmt: ue8m0`, else float32);
* each routed expert's `w1`, `w2`, `w3` with expert_dtype "fp4" is e2m1 packed two a byte, stored as
  int8 [N, K / 2], with a float8_e8m0fnu `.scale` [N, K / 32]; with "fp8", as the linears;
* the compressors' `wkv` and `wgate`, the indexer's `weights_proj`, the router, embeddings, head,
  norms, sinks and hyper-connection weights are stored unquantized (bfloat16 or float32).

mla-func holds `wo_a` dequantized (its grouped product reads it per group), and in a layer with a
compressor the FP8 `wq_a` and `wkv` dequantized too, since they are rows of one product with the
compressors' unquantized projections (`V4AttentionParams.in_proj`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from mla_func.checkpoint.fp8 import activation_scale_fmt
from mla_func.checkpoint.quant_layout import FP4_FORMAT, QuantLayout, StoredFormat, fp8_format
from mla_func.core.config import ModelConfig
from mla_func.models.v4.config import SLIDING, v4_fields
from mla_func.models.v4.quantization_config import v4_quantization

_LINEAR = re.compile(r"^(model\.layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                     r"|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")
_ROUTED = re.compile(r"^(model\.layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_LAYER = re.compile(r"^(model\.layers|mtp)\.(\d+)\.attn\.(wq_a|wkv|wo_a)\.weight$")


def v4_quant_layout(config: ModelConfig, raw: Mapping[str, Any], label: str) -> QuantLayout | None:
    """The `QuantLayout` of a V4 folder whose config.json is `raw` (None: float weights), named as
    `params.canonical_names` names them; see the module docstring."""
    quantization = v4_quantization(raw, label)
    if quantization is None:
        return None
    block, expert_dtype, scale_dtype = quantization
    linear = fp8_format(block, scale_dtype)
    routed = FP4_FORMAT if expert_dtype == "fp4" else linear
    v = v4_fields(config)
    layer_types = v.layer_types

    def format_of(name: str) -> StoredFormat | None:
        if _ROUTED.match(name):
            return routed
        return linear if _LINEAR.match(name) else None

    def held_dense(name: str) -> bool:
        found = _LAYER.match(name)
        if found is None:
            return False
        where, index, module = found.group(1), int(found.group(2)), found.group(3)
        # The first MTP layer is of the type its compress ratio says (`mtp`): as a decoder layer of that type,
        # a sliding one keeps its wq_a and wkv pairs.
        if where == "mtp":
            compressed = index == 0 and v.mtp_layer_type != SLIDING
        else:
            compressed = index < len(layer_types) and layer_types[index] != SLIDING
        return module == "wo_a" or compressed

    return QuantLayout(block=block, format_of=format_of, scale_suffix=".scale", weight_suffix=".weight",
                       held_dense=held_dense, activation_scale_fmt=activation_scale_fmt(raw))
