"""The weights of DeepSeek-V3.2's lightning indexer (one per layer), by their checkpoint names.

The indexer scores every earlier token for each query with its own small
projections: a query of `index_n_heads` heads from the low-rank query residual
(`wq_b`), one key per token from the layer's normalised input (`wk`, then a
LayerNorm with bias), and per-head weights from the same input (`weights_proj`).

`wq_b` and `wk` project the same inputs as the attention's `q_b_proj` and
`qkv_a_proj`, so the params hold them as those matrices' last rows: a decode step
then runs two GEMMs where it ran four (`indexer_projections` hands them to the
layer's loader; `IndexerParams` keeps the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_func.core.config import ModelConfig
from mla_func.kernels.quantized import Weight
from mla_func.pytree import register_dataclass

# transformers builds the key's LayerNorm with this epsilon whatever the config says.
INDEX_KEY_NORM_EPS = 1e-6


@register_dataclass
@dataclass(frozen=True, slots=True)
class IndexerParams:
    """One layer's indexer (Hi heads of Di dims, D hidden) beside its two projections, which are
    the last rows of the attention's matrices: `wq_b` [Hi * Di, Q] of `q_b_proj`, `wk` [Di, D]
    of `qkv_a_proj`."""

    k_norm: torch.Tensor        # [Di] LayerNorm weight of the key
    k_norm_bias: torch.Tensor   # [Di] LayerNorm bias of the key
    weights_proj: torch.Tensor  # [Hi, D] per-head weights, float32 (or float64 in a float64 model)


def indexer_tensor_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The indexer tensors of one layer (`prefix` is "model.layers.{i}.self_attn.") with their shapes;
    none for a model without an indexer."""
    c = config
    if not c.has_indexer or c.index_n_heads is None or c.index_head_dim is None or c.q_lora_rank is None:
        return {}
    i = prefix + "indexer."
    heads, dim = c.index_n_heads, c.index_head_dim
    return {
        i + "wq_b.weight": (heads * dim, c.q_lora_rank),
        i + "wk.weight": (dim, c.hidden_size),
        i + "k_norm.weight": (dim,),
        i + "k_norm.bias": (dim,),
        i + "weights_proj.weight": (heads, c.hidden_size),
    }


INDEXER_TENSORS_PER_LAYER = 5


def indexer_projections(config: ModelConfig, prefix: str,
                        get: Callable[[str], Weight]) -> tuple[Weight, Weight] | None:
    """(wq_b [Hi * Di, Q], wk [Di, D]) of one layer from `get(name)`, or None without an indexer:
    the rows the layer's loader appends to `q_b_proj` and `qkv_a_proj`."""
    if not config.has_indexer:
        return None
    i = prefix + "indexer."
    return get(i + "wq_b.weight"), get(i + "wk.weight")


def indexer_params(config: ModelConfig, prefix: str, get: Callable[[str], torch.Tensor],
                   wide: torch.dtype) -> IndexerParams | None:
    """One layer's indexer from `get(name)` (a loader's checked fetch), or None without an indexer.

    The head weights are held in `wide` (at least float32): the reference computes them in
    float32 from the widened input, and they scale every score.
    """
    if not config.has_indexer:
        return None
    i = prefix + "indexer."
    return IndexerParams(
        k_norm=get(i + "k_norm.weight"),
        k_norm_bias=get(i + "k_norm.bias"),
        weights_proj=get(i + "weights_proj.weight").to(wide),
    )
