"""A DeepSeek-V3 FP8 checkpoint's multi-token-prediction layer loads as it ships (`load_model(mtp=True)`): its
decoder layer's projections stay FP8 pairs, kv_b_proj's per-head W_UK and W_UV included, and the drafter's
logits are those of the same checkpoint with the FP8 weights' float values.

(DeepSeek-V4's released FP8 / FP4 MTP layer: tests/models/v4/test_v4_mtp.py.)
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

import mla_func as mf
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.mtp.layer import drafter_params, init_drafter_state, mtp_layer, target_step_fn
from support.fp8_official import write_fp8_checkpoint
from support.mla_reference import rel_err
from support.mtp_checkpoints import mtp_checkpoint

# Dimensions past one block and not multiples of 128 (as tests/checkpoint/test_fp8_load.py's).
WIDE = dict(vocab_size=97, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, q_lora_rank=144,
            kv_lora_rank=136, num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=40, qk_rope_head_dim=8,
            v_head_dim=56, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
            n_group=2, topk_group=1, num_hidden_layers=2)


def _draft_logits(model: mf.Model, tokens: list[int]) -> torch.Tensor:
    """The drafter's logits for every position of `tokens` after one target prefill over them."""
    state = mf.init_state(model, num_blocks=16, block_size=4)
    table = (1, 2, 3, 4)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), 0, table, len(tokens)),))
    out, state = target_step_fn(model.params, state, *mf.plan_step(model.config, state, plan))
    dstate = init_drafter_state(model, state)
    shifted = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens[1:]), 0, table, len(tokens) - 1),))
    batch, mode = mf.plan_step(model.config, dstate, shifted)
    drafted, _ = mf.forward_outputs(drafter_params(model), dstate, replace(batch, hidden=out.hidden[:-1]), mode,
                                    layers=(mtp_layer(model.config),))
    return drafted.logits[: mode.num_logits]


def test_the_mtp_layer_of_an_fp8_checkpoint_runs_on_its_pairs(tmp_path):
    _, path = mtp_checkpoint(tmp_path / "float", seed=random.randrange(1000), **WIDE)
    quantized = write_fp8_checkpoint(path, tmp_path / "fp8", tmp_path / "dequantized")
    mtp_prefix = f"model.layers.{WIDE['num_hidden_layers']}."
    assert any(name.startswith(mtp_prefix + "self_attn.kv_b_proj") for name in quantized)
    fp8 = mf.load_model(tmp_path / "fp8", mtp=True, dtype=torch.float64, device="cpu")
    dense = mf.load_model(tmp_path / "dequantized", mtp=True, dtype=torch.float64, device="cpu")
    layer = fp8.mtp.layer
    a = layer.attn
    for weight in (a.qkv_a_proj, a.q_b_proj, a.w_uk, a.w_uv, a.o_proj, layer.mlp.w13, layer.mlp.w2):
        assert isinstance(weight, BlockFP8Weight) and weight.values.element_size() == 1
    assert isinstance(dense.mtp.layer.attn.w_uk, torch.Tensor)
    tokens = [random.randrange(fp8.config.vocab_size) for _ in range(13)]
    got, want = _draft_logits(fp8, tokens), _draft_logits(dense, tokens)
    assert got.shape == want.shape == (12, fp8.config.vocab_size)
    # The same float64 math on the same values: only the order of sums may differ.
    assert rel_err(got, want) < 1e-10
