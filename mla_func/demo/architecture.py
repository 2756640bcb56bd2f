"""The demo model's architecture (DeepSeek-V3 in miniature) and its initial weights."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from mla_func.core.config import ModelConfig
from mla_func.core.params import Params, params_from_hf
from mla_func.models.mla.family import MLA
from mla_func.models.mtp.params import MTPParams, load_mtp, mtp_tensor_shapes
from mla_func.models.tensor_shapes import hf_tensor_shapes
from mla_func.pytree import tree_leaves


def demo_model_config(vocab_size: int, **overrides: Any) -> ModelConfig:
    """The demo architecture: DeepSeek-V3 in miniature.

    MLA with a low-rank query (q_lora_rank) and a 64-dim latent cache; one dense
    layer, then MoE layers of 8 routed experts (top-2, sigmoid scores, noaux_tc
    group-limited routing over 4 groups of 2, normalised weights) plus one shared
    expert. Token ids 0 and 1 are <|bos|> and <|eos|>. Embeddings are tied, which
    halves the largest matrix of so small a model.
    """
    config = ModelConfig(
        family=MLA,
        model_type="deepseek_v3",
        vocab_size=vocab_size,
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=512,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=96,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_ids=(1,),
    )
    return dataclasses.replace(config, **overrides)


def _initial(shapes: dict[str, tuple[int, ...]], config: ModelConfig, seed: int) -> Callable[[str], torch.Tensor]:
    """GPT-2's scheme: matrices ~ N(0, 0.02), with the projections that write into
    the residual stream (o_proj, down_proj) scaled by 1 / sqrt(2 * layers) so the
    stream's variance does not grow with depth; norm weights 1, correction bias 0.
    Drawn on the CPU, so every device gets the same."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * config.num_hidden_layers)

    def fetch(name: str) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    return fetch


def init_params(config: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Params:
    """Fresh float32 weights on `device`, built through `params_from_hf` from names of `hf_tensor_shapes`
    (the scheme of `_initial`)."""
    fetch = _initial(hf_tensor_shapes(config), config, seed)
    return params_from_hf(config, fetch, dtype=torch.float32, device=device)


def init_mtp_params(config: ModelConfig, params: Params, seed: int) -> MTPParams:
    """A fresh MTP layer (DeepSeek-V3's depth-1 module) for `params`, built through `load_mtp` from the
    names of `mtp_tensor_shapes`: its embedding and head are `params`' own tensors (shared, as in
    DeepSeek-V3), everything else drawn as `init_params` draws a layer's, from its own generator
    (seeded `seed + 1`), so the main model's initial weights do not depend on whether it has one."""
    fetch = _initial(mtp_tensor_shapes(config), config, seed + 1)
    return load_mtp(config, params, fetch, torch.float32, params.embed.device, frozenset())


def count_parameters(params: Params, mtp: MTPParams | None = None) -> tuple[int, int]:
    """(the model's parameters, the MTP layer's own: those it does not share with the model), each
    tensor counted once (tied embeddings), the RoPE tables left out."""
    model = {id(t): t.numel() for t in tree_leaves(params) if t is not params.rope_cos and t is not params.rope_sin}
    own = {id(t): t.numel() for t in tree_leaves(mtp) if id(t) not in model}
    return sum(model.values()), sum(own.values())
