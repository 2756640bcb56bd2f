"""RoPE tables: cos and sin of each position's angles (YaRN included), for as many positions as a model runs.

The kernels read rows of these [P, R / 2] tables at each token's position; P is
bounded by what an engine uses, never by a config's claim alone.
"""

from __future__ import annotations

import math

import torch

from mla_func.core.config import ModelConfig


# Positions the RoPE tables cover when no max_model_len is given: every DeepSeek
# release's max_position_embeddings (163,840) and under 70 MB of tables at R = 64.
# A config that declares more (10**12 would be 4 TB of tables) gets tables up to
# this, and an engine asking for a longer max_model_len builds longer ones.
DEFAULT_MAX_POSITIONS = 1 << 18


def rope_positions(config: ModelConfig, max_model_len: int | None = None) -> int:
    """How many positions RoPE tables cover: max_model_len, by default
    min(max_position_embeddings, DEFAULT_MAX_POSITIONS). ValueError past the model's maximum."""
    if max_model_len is None:
        return min(config.max_position_embeddings, DEFAULT_MAX_POSITIONS)
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )
    return max_model_len


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R / 2] (float32) and the attention factor scaling cos/sin.

    YaRN blends interpolated and extrapolated frequencies with a linear ramp
    between the correction dims of beta_fast and beta_slow.
    """
    rope, dim = config.rope, config.qk_rope_head_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0

    original = rope.original_max_position_embeddings
    if original is None:  # RopeConfig refuses YaRN without it; this narrows the type
        raise ValueError("YaRN needs rope_parameters.original_max_position_embeddings")

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight

    return inv_freq, rope.attention_scale


def rope_tables(
    config: ModelConfig, device: torch.device | str, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_positions, R / 2] float32, attention factor applied."""
    inv_freq, attention_factor = rope_inv_freq(config)
    positions = torch.arange(num_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return (
        (freqs.cos() * attention_factor).to(device),
        (freqs.sin() * attention_factor).to(device),
    )
