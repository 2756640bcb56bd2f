"""The params pytree every model has, and building it from a checkpoint's tensors through the model's family.

`Params` holds what every family shares (the embedding, the final norm, the LM head, the RoPE
tables) and one params pytree per layer, of that layer's kind. A family builds them from
tensors named as in its Hugging Face checkpoints (`Family.params_from_hf`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mla_func.checkpoint.files import CheckpointError
from mla_func.core.config import ModelConfig
from mla_func.core.rope_tables import rope_positions
from mla_func.pytree import register_dataclass, static_field


@register_dataclass
@dataclass(frozen=True, slots=True)
class Params:
    """All weights of a model, plus the RoPE tables derived from its config.

    `config` is tree metadata, so pure functions need only `params`. The tables
    cover `max_positions` positions (see `rope_positions`): a sequence may not
    grow past them.
    """

    embed: torch.Tensor                   # [V, D]
    layers: tuple[Any, ...]               # one params pytree per layer, of its kind (`LayerParams` for MLA layers)
    norm: torch.Tensor                    # [D]
    lm_head: torch.Tensor                 # [V, D] (the embedding itself when tied)
    rope_cos: torch.Tensor                # [P, R / 2] float32, P = max_positions
    rope_sin: torch.Tensor                # [P, R / 2] float32
    config: ModelConfig = static_field()

    @property
    def max_positions(self) -> int:
        """Positions the RoPE tables cover: no sequence may be longer."""
        return self.rope_cos.shape[0]

    def with_max_positions(self, max_positions: int) -> Params:
        """These params with RoPE tables covering `max_positions` positions (<= max_position_embeddings)."""
        if max_positions == self.max_positions:
            return self
        return self.config.family.with_max_positions(self, rope_positions(self.config, max_positions))


TensorFetch = Callable[[str], torch.Tensor]


def params_from_hf(
    config: ModelConfig,
    fetch: TensorFetch,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: bool = False,
    max_model_len: int | None = None,
) -> Params:
    """Build the params pytree from tensors named as in a Hugging Face checkpoint, as the model's family does.

    `fetch(name)` returns one tensor (already checked against `tensor_shapes.hf_tensor_shapes`);
    it is called once per name, layer by layer, so a large model never holds two
    copies of more than one layer's experts. `progress` shows a bar over layers.
    The RoPE tables cover `rope_positions(config, max_model_len)` positions.
    Raises CheckpointError naming a tensor that holds NaN or inf once converted.
    """
    return config.family.params_from_hf(config, fetch, dtype=dtype, device=device, progress=progress,
                                        max_model_len=max_model_len)


TensorGet = Callable[..., torch.Tensor]


def checked_fetch(fetch: TensorFetch, *, dtype: torch.dtype, device: torch.device | str) -> TensorGet:
    """`get(name, keep_float32=False)`: `fetch(name)` on `device` in `dtype` (or float32), checked finite."""

    def get(name: str, keep_float32: bool = False) -> torch.Tensor:
        tensor = fetch(name).to(device=device, dtype=torch.float32 if keep_float32 else dtype)
        # One host sync a tensor, at load time: a NaN weight would otherwise give token 0 forever.
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"tensor {name!r} holds NaN or inf values (as {tensor.dtype})")
        return tensor

    return get
