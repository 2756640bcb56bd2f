"""A loaded model: its config, params, tokenizer, chat template and optional MTP layer, as one value."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mla_func.checkpoint.chat_template import ChatTemplate
from mla_func.core.config import ModelConfig
from mla_func.core.params import Params
from mla_func.kernels.quantized import FP8_DTYPE
from mla_func.pytree import tree_leaves


@dataclass(frozen=True, slots=True)
class Model:
    """A loaded model: its config, its params pytree, its tokenizer and chat template when it has them,
    and its first multi-token-prediction layer when loaded with `mtp=True` (the drafter of speculative decoding)."""

    config: ModelConfig
    params: Params
    tokenizer: Any = None  # tokenizers.Tokenizer, or None
    # The drafter's params pytree (`models.mtp.params.MTPParams`), typed loosely: the MTP layer belongs to its
    # model folder, above this package, and only the code there reads it.
    mtp: Any = None
    chat_template: ChatTemplate | None = None  # renders chat prompts (see `mla_func.checkpoint.chat_template`)

    @property
    def device(self) -> torch.device:
        return self.params.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.params.embed.dtype

    @property
    def has_fp8_weights(self) -> bool:
        """Whether any projection or expert of the model (its MTP layer aside) is a block-scaled FP8 pair."""
        return any(leaf.dtype == FP8_DTYPE for leaf in tree_leaves(self.params))

    @property
    def max_positions(self) -> int:
        """Positions its RoPE tables cover: the longest sequence it can run."""
        return self.params.max_positions

    def with_max_positions(self, max_positions: int) -> Model:
        """This model with RoPE tables for `max_positions` positions (ValueError past max_position_embeddings)."""
        return dataclasses.replace(self, params=self.params.with_max_positions(max_positions))
