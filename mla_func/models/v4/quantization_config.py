"""DeepSeek-V4's `quantization_config` and `expert_dtype`: what config.json says about its stored weights
(the layout itself is `quant_layout`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mla_func.checkpoint.files import CheckpointError
from mla_func.checkpoint.fp8 import block_size

EXPERT_DTYPES = ("fp4", "fp8")


def v4_quantization(raw: Mapping[str, Any], label: str = "config.json") -> tuple[tuple[int, int], str, str] | None:
    """(block, expert_dtype, scale dtype) of a V4 config.json dict, or None without `quantization_config`.

    CheckpointError naming the field for a quantization_config other than block-scaled FP8 (with
    `expert_dtype` allowed inside it), an expert_dtype other than "fp4" / "fp8", two that disagree,
    or one without a quantization_config.
    """
    quant = raw.get("quantization_config")
    top = raw.get("expert_dtype")
    if quant is None:
        if top is not None:
            raise CheckpointError(f"{label}: expert_dtype is {top!r}, but there is no quantization_config")
        return None
    if not isinstance(quant, dict):
        raise CheckpointError(f"{label}: quantization_config is {quant!r}, not an object")
    inner = quant.get("expert_dtype")
    if top is not None and inner is not None and top != inner:
        raise CheckpointError(f"{label}: expert_dtype is {top!r}, but quantization_config.expert_dtype is {inner!r}")
    expert_dtype = top if top is not None else inner if inner is not None else "fp4"
    if expert_dtype not in EXPERT_DTYPES:
        raise CheckpointError(f"{label}: expert_dtype is {expert_dtype!r}; expected one of {list(EXPERT_DTYPES)}")
    rest = {k: v for k, v in quant.items() if k != "expert_dtype"}
    block = block_size({"quantization_config": rest}, label)
    assert block is not None  # for the type checker: a quantization_config was given
    return block, expert_dtype, "F8_E8M0" if rest.get("scale_fmt") == "ue8m0" else "F32"
