"""The tensors of a DeepSeek-V2/V3/V3.2 checkpoint (the MLA and DSA families): names and shapes, and how many."""

from __future__ import annotations

from mla_func.core.config import ModelConfig
from mla_func.models.mla.indexer_params import INDEXER_TENSORS_PER_LAYER, indexer_tensor_shapes

__all__ = ["layer_tensor_shapes", "mla_tensor_count", "mla_tensor_shapes"]


def mla_tensor_count(config: ModelConfig) -> int:
    """len(mla_tensor_shapes(config)), counted without listing them (a config may claim 10**9 layers)."""
    c = config
    attention = 4 + (1 if c.q_lora_rank is None else 3) + (INDEXER_TENSORS_PER_LAYER if c.has_indexer else 0)
    moe_layers = 0 if c.n_routed_experts is None else max(0, c.num_hidden_layers - c.first_k_dense_replace)
    dense_layers = c.num_hidden_layers - moe_layers
    per_moe = 1 + (c.topk_method == "noaux_tc") + 3 * (c.n_routed_experts or 0) + 3 * bool(c.n_shared_experts)
    return 2 + (not c.tie_word_embeddings) + c.num_hidden_layers * (2 + attention) + dense_layers * 3 + moe_layers * per_moe


def mla_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a DeepSeek-V2/V3/V3.2 checkpoint of `config` holds, by name, with its shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                          "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        shapes.update(layer_tensor_shapes(c, i))
    return shapes


def layer_tensor_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer `i` (`model.layers.{i}.`), by name, with their shapes."""
    c = config
    d, h = c.hidden_size, c.num_attention_heads
    p = f"model.layers.{i}."
    shapes: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    a = p + "self_attn."
    if c.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (h * c.qk_head_dim, d)
    else:
        shapes[a + "q_a_proj.weight"] = (c.q_lora_rank, d)
        shapes[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (h * c.qk_head_dim, c.q_lora_rank)
    shapes[a + "kv_a_proj_with_mqa.weight"] = (c.kv_cache_dim, d)
    shapes[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    shapes[a + "kv_b_proj.weight"] = (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    shapes[a + "o_proj.weight"] = (d, h * c.v_head_dim)
    shapes.update(indexer_tensor_shapes(c, a))
    m = p + "mlp."
    if c.is_moe_layer(i):
        e, inter = c.n_routed_experts or 0, c.moe_intermediate_size  # is_moe_layer: not None
        shapes[m + "gate.weight"] = (e, d)
        if c.topk_method == "noaux_tc":
            shapes[m + "gate.e_score_correction_bias"] = (e,)
        for j in range(e):
            shapes.update(_mlp_shapes(f"{m}experts.{j}.", d, inter))
        if c.n_shared_experts:
            shapes.update(_mlp_shapes(m + "shared_experts.", d, inter * c.n_shared_experts))
    else:
        shapes.update(_mlp_shapes(m, d, c.intermediate_size))
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }
