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
from mla_func.kernels.collectives import SINGLE_PROCESS
from mla_func.kernels.ops import CollectiveOps
from mla_func.kernels.quantized import Weight
from mla_func.pytree import register_dataclass, static_field


@register_dataclass
@dataclass(frozen=True, slots=True)
class Params:
    """All weights of a model, plus the RoPE tables derived from its config.

    `config` and `collectives` are tree metadata, so pure functions need only `params`. The tables
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
    # The ranks these params are one shard of (`mla_func.parallel`); the forward calls these collectives
    # unless given a table bound to them. One process: SINGLE_PROCESS, every op an identity.
    collectives: CollectiveOps = static_field(default=SINGLE_PROCESS)

    @property
    def max_positions(self) -> int:
        """Positions the RoPE tables cover: no sequence may be longer."""
        return self.rope_cos.shape[0]

    def with_max_positions(self, max_positions: int) -> Params:
        """These params with RoPE tables covering `max_positions` positions (<= max_position_embeddings)."""
        if max_positions == self.max_positions:
            return self
        return self.config.family.with_max_positions(self, rope_positions(self.config, max_positions))


# A checkpoint tensor by name: a block-scaled FP8 projection comes as its (values, scales) pair.
TensorFetch = Callable[[str], Weight]


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

    `fetch(name)` returns one tensor (already checked against `tensor_shapes.hf_tensor_shapes`), or
    for a projection an FP8 checkpoint stores quantized, its (values, scales) pair, already checked;
    it is called once per name, layer by layer, so a large model never holds two
    copies of more than one layer's experts. `progress` shows a bar over layers.
    The RoPE tables cover `rope_positions(config, max_model_len)` positions.
    Raises CheckpointError naming a tensor that holds NaN or inf once converted.
    """
    return config.family.params_from_hf(config, fetch, dtype=dtype, device=device, progress=progress,
                                        max_model_len=max_model_len)


@dataclass(frozen=True, slots=True)
class TensorGet:
    """A family's view of the checkpoint while it builds params: `get(name)` a plain tensor,
    `get.weight(name)` a projection weight, which may be a block-scaled FP8 pair.

    Both return the tensor on `device` (plain tensors in `dtype`, or float32 when asked), checked
    finite: one host sync a tensor, at load time, since a NaN weight would otherwise give token 0
    forever. A pair keeps its FP8 values and float32 scales (checked by the loader when read).
    """

    fetch: TensorFetch
    dtype: torch.dtype
    device: torch.device | str

    def __call__(self, name: str, keep_float32: bool = False) -> torch.Tensor:
        """Tensor `name` on the device in the model dtype (float32 with keep_float32)."""
        value = self.fetch(name)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"tensor {name!r} is stored quantized, but the model holds it as a plain "
                                  "tensor")
        return self._checked(name, value.to(device=self.device, dtype=torch.float32 if keep_float32 else self.dtype))

    def weight(self, name: str) -> Weight:
        """Projection weight `name` [N, K]: an FP8 pair as stored, or a tensor as `get(name)` reads it."""
        value = self.fetch(name)
        if not isinstance(value, torch.Tensor):
            return value.to(self.device)
        return self._checked(name, value.to(device=self.device, dtype=self.dtype))

    @staticmethod
    def _checked(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"tensor {name!r} holds NaN or inf values (as {tensor.dtype})")
        return tensor


def checked_fetch(fetch: TensorFetch, *, dtype: torch.dtype, device: torch.device | str) -> TensorGet:
    """`get(name, keep_float32=False)` and `get.weight(name)` over `fetch` (see `TensorGet`)."""
    return TensorGet(fetch=fetch, dtype=dtype, device=device)
