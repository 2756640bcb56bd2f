"""The demo trainer: torch.optim's AdamW, clipping and schedule over the params pytree's leaves."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
import torch

import mla_func as mf
from mla_func.demo.architecture import demo_model_config, init_mtp_params, init_params
from mla_func.demo.export import params_to_hf, save_checkpoint
from mla_func.demo.leaves import LeafLayout
from mla_func.demo.train import TrainConfig, make_optimizer, train
from mla_func.models.mtp.params import mtp_tensor_shapes
from mla_func.models.tensor_shapes import hf_tensor_shapes
from mla_func.pytree import tree_leaves

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=48,
             moe_intermediate_size=16, max_position_embeddings=64)


def test_schedule_is_linear_warmup_then_cosine_to_the_floor():
    cfg = TrainConfig(steps=40, warmup_steps=6, lr=3e-3, min_lr_ratio=0.1)
    optimizer, schedule = make_optimizer([torch.zeros(2, 2), torch.zeros(2)], cfg)
    got = []
    for _ in range(cfg.steps):
        got.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    floor = cfg.lr * cfg.min_lr_ratio
    want = [cfg.lr * (s + 1) / cfg.warmup_steps if s < cfg.warmup_steps else
            floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * (s - cfg.warmup_steps) / (cfg.steps - 1 - cfg.warmup_steps)))
            for s in range(cfg.steps)]
    assert got == pytest.approx(want, rel=1e-9)
    assert got[cfg.warmup_steps - 1] == pytest.approx(cfg.lr) and got[-1] == pytest.approx(floor)


def test_weight_decay_is_on_matrices_only():
    matrix, vector = torch.ones(3, 3), torch.ones(3)
    optimizer, _ = make_optimizer([matrix, vector], TrainConfig(weight_decay=0.5, lr=0.1, warmup_steps=0))
    matrix.grad, vector.grad = torch.zeros(3, 3), torch.zeros(3)
    optimizer.step()
    assert torch.allclose(matrix, torch.full((3, 3), 1 - 0.1 * 0.5)) and torch.equal(vector, torch.ones(3))


def test_training_lowers_the_loss_and_leaves_the_input_params_alone():
    config = demo_model_config(64, **SMALL)
    params = init_params(config, seed=0)
    before = [t.clone() for t in tree_leaves(params)]
    windows = _pattern_windows(16, 16, 0)
    cfg = TrainConfig(steps=40, warmup_steps=4, batch_size=4, seq_len=16, block_size=16, lr=1e-2, model=SMALL)
    trained, _, log = train(params, windows, cfg, progress=False)
    losses = log["losses"]
    assert len(losses) == cfg.steps and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves(params)))
    changed = [not torch.equal(a, b) for a, b in zip(tree_leaves(params), tree_leaves(trained))]
    assert sum(changed) >= len(LeafLayout(params).trainable) - 1


def _pattern_windows(count: int, length: int, seed: int) -> list[list[int]]:
    """Windows of a learnable pattern: each token follows from the one before it."""
    rng = random.Random(seed)
    windows = []
    for _ in range(count):
        start, step = rng.randrange(2, 64), rng.choice((1, 3))
        windows.append([2 + (start + step * i) % 62 for i in range(length + 1)])
    return windows


def test_training_with_an_mtp_layer_lowers_both_losses_and_keeps_the_head_shared():
    config = demo_model_config(64, **SMALL)
    params = init_params(config, seed=0)
    mtp = init_mtp_params(config, params, seed=0)
    before = [t.clone() for t in tree_leaves(mtp)]
    cfg = TrainConfig(steps=40, warmup_steps=4, batch_size=4, seq_len=16, block_size=16, lr=1e-2, model=SMALL,
                      mtp_late_fraction=0.5)
    assert [cfg.mtp_weight_at(s) for s in (0, 19, 20, 39)] == [0.3, 0.3, 0.1, 0.1]
    trained, trained_mtp, log = train(params, _pattern_windows(16, 16, 1), cfg, mtp=mtp, progress=False)
    for losses in (log["losses"], log["mtp_losses"]):
        assert len(losses) == cfg.steps and all(math.isfinite(x) for x in losses)
        assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert trained_mtp is not None
    # One tensor: the embedding, the tied head and the MTP layer's embedding and head.
    assert trained_mtp.embed is trained.embed and trained_mtp.head is trained.lm_head is trained.embed
    assert not torch.equal(trained.embed, params.embed)
    assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves(mtp)))      # the input left alone
    changed = [not torch.equal(a, b) for a, b in zip(tree_leaves(mtp), tree_leaves(trained_mtp))]
    assert sum(changed) >= len(changed) - 1   # all but (maybe) the correction bias of an unused expert
    # Without the MTP layer the same run has no MTP loss.
    _, none, plain_log = train(params, _pattern_windows(16, 16, 1), replace(cfg, steps=2), progress=False)
    assert none is None and all(math.isnan(x) for x in plain_log["mtp_losses"])


def test_an_exported_mtp_layer_loads_back_through_load_model(tmp_path):
    config = demo_model_config(64, **SMALL)
    params = init_params(config, seed=2)
    mtp = init_mtp_params(config, params, seed=2)
    save_checkpoint(tmp_path, params, mtp=mtp, weight_dtype=torch.float32)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1
    names = set(params_to_hf(params, mtp))
    assert names == set(hf_tensor_shapes(config)) | set(mtp_tensor_shapes(config))
    model = mf.load_model(tmp_path, mtp=True, dtype=torch.float32, device="cpu")
    assert model.mtp is not None
    for a, b in zip(tree_leaves((params, mtp)), tree_leaves((model.params, model.mtp)), strict=True):
        assert torch.equal(a, b)
    # An MTP layer with its own head (untied) writes it, and it loads back as its own.
    own = replace(mtp, head=mtp.head + 1)
    assert f"model.layers.{config.num_hidden_layers}.shared_head.head.weight" in params_to_hf(params, own)
    save_checkpoint(tmp_path / "own", params, mtp=own, weight_dtype=torch.float32)
    loaded = mf.load_model(tmp_path / "own", mtp=True, dtype=torch.float32, device="cpu").mtp
    assert loaded is not None and torch.equal(loaded.head, own.head) and torch.equal(loaded.embed, params.embed)
    with pytest.raises(ValueError, match="mtp_layers: expected 0 or 1"):
        TrainConfig(mtp_layers=2)
