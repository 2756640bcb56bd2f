"""The DSA family: DeepSeek-V3.2 (model_type deepseek_v32), MLA with DeepSeek Sparse Attention, as a `Family`.

V3.2 is V3 plus an indexer in every layer: its params, checkpoint names and
config.json are V3's with the indexer's (`indexer_params`, read by the same
loaders as `models.mla.family`'s), and every layer, its MTP layer included, is a sparse
attention layer (`models.dsa.attention.DSA_DECODER`) that attends row by row.
"""

from __future__ import annotations

import dataclasses

from mla_func.core.config import ModelConfig, validate_indexer
from mla_func.core.family import Family
from mla_func.core.layers import LayerKind
from mla_func.models.dsa.attention import DSA_DECODER, DSA_DECODER_FP8
from mla_func.models.mla.family import MLA, refuse_family_fields
from mla_func.models.mtp.layer import mla_mtp

__all__ = ["DSA"]


def _validate(c: ModelConfig) -> None:
    refuse_family_fields(c)
    validate_indexer(c)


def _layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    return (DSA_DECODER,) * config.num_hidden_layers


def _fp8_cache_layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    return (DSA_DECODER_FP8,) * config.num_hidden_layers


# MLA's record but for what the indexer changes: its config checks, its layer kinds (its MTP
# layer's too), and row-by-row attention in every step.
DSA: Family = dataclasses.replace(
    MLA,
    name="dsa",
    title="DeepSeek-V3.2",
    model_types=("deepseek_v32",),
    validate=_validate,
    layer_kinds=_layer_kinds,
    fp8_cache_layer_kinds=_fp8_cache_layer_kinds,
    attends_by_row=True,
    mtp=mla_mtp(DSA_DECODER),
)
