"""The quantization layout of DeepSeek's released FP8 checkpoints with `weight_scale_inv`, as a `QuantLayout`.

Names and checks are the format's (`fp8`: `is_quantized_name`, `<weight>_scale_inv` in float32, one
block size from config.json); the loader reads any layout the same way (`quant_layout`). This is the
layout of a family that declares none of its own (`Family.quant_layout` None).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mla_func.checkpoint.fp8 import SCALE_SUFFIX, activation_scale_fmt, block_size, is_quantized_name
from mla_func.checkpoint.quant_layout import QuantLayout, StoredFormat, fp8_format

if TYPE_CHECKING:
    from mla_func.core.config import ModelConfig


def released_fp8_layout(config: ModelConfig | None, raw: Mapping[str, Any], label: str) -> QuantLayout | None:
    """The layout of a folder whose config.json is `raw`: None without a `quantization_config`, else
    every weight `is_quantized_name` names as float8_e4m3fn with a float32 `_scale_inv` per block, its w8a8
    activations scaled as the config's `scale_fmt` says (`fp8.activation_scale_fmt`).
    CheckpointError naming the field for any other quantization_config (`fp8.block_size`)."""
    block = block_size(raw, label)
    if block is None:
        return None
    fmt = fp8_format(block)

    def format_of(name: str) -> StoredFormat | None:
        return fmt if is_quantized_name(name, raw) else None

    return QuantLayout(block=block, format_of=format_of, scale_suffix=SCALE_SUFFIX,
                       activation_scale_fmt=activation_scale_fmt(raw))
