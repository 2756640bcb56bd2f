"""Named models: shape presets with random weights, and models that ship with the package.

Two kinds of names, kept apart because they are built differently:

* `PRESETS`: name -> config factory; `load_model(name)` draws random weights of
  those shapes (for tests and benchmarks);
* `SHIPPED_PRESETS`: name -> a checkpoint folder inside the package (trained
  weights, config.json, tokenizer.json); `load_model(name)` loads the folder.

`preset_names()` lists both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from mla_func.core.config import ModelConfig, RopeConfig
from mla_func.models.dsa.family import DSA
from mla_func.models.mla.family import MLA
from mla_func.models.v4.presets import v4_mini, v4_tiny


def tiny() -> ModelConfig:
    """A few-layer DeepSeek-V3-shaped model for CPU tests (MLA with q_lora, MoE with noaux_tc)."""
    return ModelConfig(
        family=MLA,
        model_type="deepseek_v3",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        max_position_embeddings=2048,
        eos_token_ids=(1,),
    )


def v2_lite() -> ModelConfig:
    """DeepSeek-V2-Lite's shapes: 27 layers, 16 heads, kv_lora_rank 512, 64 experts top-6 + 2 shared."""
    return ModelConfig(
        family=MLA,
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=10944,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        moe_intermediate_size=1408,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        scoring_func="softmax",
        topk_method="greedy",
        rope=RopeConfig(
            theta=10000.0,
            kind="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        eos_token_ids=(100001,),
    )


def v32_lite() -> ModelConfig:
    """V2-Lite's layers, hidden size, heads and experts with DeepSeek-V3.2's sparse attention: a low-rank
    query (q_lora_rank 1536, the residual the indexer's query comes from) and V3.2's indexer, 64 heads of
    128 dims keeping the 2048 best keys. V3.2 routes by sigmoid scores with noaux_tc (one group here)."""
    return dataclasses.replace(
        v2_lite(),
        family=DSA,
        model_type="deepseek_v32",
        q_lora_rank=1536,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
    )


PRESETS: Mapping[str, Callable[[], ModelConfig]] = MappingProxyType({
    "tiny": tiny,
    "v2-lite": v2_lite,
    "v32-lite": v32_lite,
    "v4-tiny": v4_tiny,
    "v4-mini": v4_mini,
})

SHIPPED_PRESETS: Mapping[str, Path] = MappingProxyType({
    # A small DeepSeek-V3-architecture model trained on the standard library's
    # docstrings by `python -m mla_func.demo.train` (see its TRAINING.md).
    "demo": Path(__file__).resolve().parent.parent / "demo" / "model",
})


def preset_names() -> list[str]:
    """Every name `load_model` accepts besides a folder path, sorted."""
    return sorted({*PRESETS, *SHIPPED_PRESETS})
