"""The quantization layout of a checkpoint folder or a quantized preset, as its family reads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mla_func.checkpoint.fp8 import QUANTIZATION_CONFIG
from mla_func.checkpoint.fp8_pairs import released_fp8_layout
from mla_func.checkpoint.quant_layout import QuantLayout
from mla_func.core.config import ModelConfig


def layout_of(config: ModelConfig, raw: Mapping[str, Any], label: str) -> QuantLayout | None:
    """Which tensors of a folder whose config.json is `raw` are stored quantized (None: float weights):
    the family's rule (`Family.quant_layout`), by default the FP8 layout of `checkpoint.fp8`."""
    rule = config.family.quant_layout or released_fp8_layout
    return rule(config, raw, label)


def preset_layout(config: ModelConfig, block: tuple[int, int] | None) -> QuantLayout | None:
    """The layout a preset quantized with FP8 linears in `block`s has: its family's released layout
    (None for block None)."""
    if block is None:
        return None
    raw = {"quantization_config": {**QUANTIZATION_CONFIG, "weight_block_size": list(block)}}
    return layout_of(config, raw, f"quantization with {block[0]} x {block[1]} blocks")
