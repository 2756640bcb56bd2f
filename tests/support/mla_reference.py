"""Small random DeepSeek-V2/V3 models from Hugging Face transformers, the numerical oracle.

Each variant is a transformers config; `make_reference` builds the model with
every weight (norms and the noaux_tc correction bias included) drawn afresh, so
that no path can hide behind a default value, and saves it with
`save_pretrained` for mla-func to load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

# The tiny V3 shape every family's reference model starts from.
TINY_V3 = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)

VARIANTS: dict[str, tuple[type, type, dict]] = {
    # DeepSeek-V3 routing: sigmoid scores, noaux_tc groups, normalised top-k; low-rank q.
    "v3-qlora-noaux": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    )),
    # V3 with YaRN (attention factor != 1) and non-interleaved rope, q without low rank.
    "v3-yarn-halfsplit": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=None, n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_interleave=False, rope_parameters=YARN,
    )),
    # DeepSeek-V2 routing: softmax scores, greedy top-k; q without low rank.
    "v2-greedy": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0,
    )),
    # V2 with group-limited greedy routing, low-rank q and YaRN.
    "v2-group-yarn": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.0, rope_parameters=YARN,
    )),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if tensor.ndim >= 2:
                std = tensor.shape[-1] ** -0.5
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
            elif "bias" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
            else:  # norm weights
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))


def make_reference(variant: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = VARIANTS[variant]
    config = config_cls(**{**TINY_V3, **extra, **overrides}, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize(model, seed)
    return model.to(dtype).eval()


def save_reference(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@torch.no_grad()
def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[T, V] logits of the whole sequence in one causal pass."""
    return model(torch.tensor([token_ids])).logits[0]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|"""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
