"""DeepSeek-V4 shape presets (random weights): a tiny one for CPU, and V4's real per-layer shapes in few layers."""

from __future__ import annotations

from typing import Any

from mla_func.core.config import ModelConfig
from mla_func.models.v4.config_hf import v4_config_from_hf_dict
from mla_func.models.v4.family import V4

_KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]


def _config(**fields: Any) -> ModelConfig:
    return v4_config_from_hf_dict({"model_type": "deepseek_v4", "layer_types": _KINDS,
                                   "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"], **fields}, V4)


def v4_tiny() -> ModelConfig:
    """A four-layer V4 for CPU tests: one layer of each kind (CSA twice), window 8, CSA 4:1, HCA 16:1."""
    return _config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=48,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, sliding_window=8,
        o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=4, hc_mult=4,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.25}},
        max_position_embeddings=2048, eos_token_id=1,
    )


def v4_mini() -> ModelConfig:
    """V4's real per-layer shapes in four layers and eight experts (fits one GPU in bf16 with random weights).

    64 heads of 512 (64 rotated), q_lora_rank 1024, 8 output groups of rank 1024, window 128, CSA 4:1 with a
    64 x 128 indexer keeping 512 entries, HCA 128:1, hc_mult 4, hidden size 4096, experts of 2048.
    """
    return v4_real_shapes(_KINDS, ["hash_moe", "hash_moe", "moe", "moe"], n_routed_experts=8)


def v4_real_shapes(layer_types: list[str], mlp_layer_types: list[str], *, n_routed_experts: int) -> ModelConfig:
    """V4's real per-layer shapes (V4-Flash's, as `v4_mini` lists them; top 6 of `n_routed_experts`) in the
    layers `layer_types` and `mlp_layer_types` name, one entry a layer."""
    return _config(
        layer_types=layer_types, mlp_layer_types=mlp_layer_types,
        vocab_size=129280, hidden_size=4096, num_hidden_layers=len(layer_types), num_attention_heads=64, head_dim=512,
        q_lora_rank=1024, moe_intermediate_size=2048, n_routed_experts=n_routed_experts, num_experts_per_tok=6,
        n_shared_experts=1,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, sliding_window=128,
        o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
        hc_sinkhorn_iters=20, swiglu_limit=10.0, routed_scaling_factor=1.5,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.125, "factor": 16.0,
                         "original_max_position_embeddings": 65536, "beta_fast": 32.0, "beta_slow": 1.0,
                         "attention_factor": 1.0},
        },
        max_position_embeddings=1048576, eos_token_id=1,
    )
