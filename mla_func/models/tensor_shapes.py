"""The tensors a Hugging Face checkpoint of a config holds: names and shapes, and how many.

The loader checks a folder against these before reading anything (missing,
unexpected and mis-shaped tensors are reported together), and shape presets draw
random weights of these shapes. The model's family lists them (`Family.tensor_shapes`).
"""

from __future__ import annotations

from mla_func.core.config import ModelConfig

__all__ = ["hf_tensor_count", "hf_tensor_shapes"]


def hf_tensor_count(config: ModelConfig) -> int:
    """len(hf_tensor_shapes(config)), counted without listing them (a config may claim 10**9 layers)."""
    return config.family.tensor_count(config)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `config` holds, by name, with its shape."""
    return config.family.tensor_shapes(config)
