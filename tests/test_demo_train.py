"""The demo trainer: torch.optim's AdamW, clipping and schedule over the params pytree's leaves."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mla_func.demo.leaves import LeafLayout
from mla_func.demo.train import TrainConfig, demo_model_config, init_params, make_optimizer, train
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
    rng = random.Random(0)
    # Windows of a learnable pattern: each token follows from the one before it.
    windows = []
    for _ in range(16):
        start, step = rng.randrange(2, 64), rng.choice((1, 3))
        windows.append([2 + (start + step * i) % 62 for i in range(17)])
    cfg = TrainConfig(steps=40, warmup_steps=4, batch_size=4, seq_len=16, block_size=16, lr=1e-2, model=SMALL)
    trained, _, log = train(params, windows, cfg, progress=False)
    losses = log["losses"]
    assert len(losses) == cfg.steps and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves(params)))
    changed = [not torch.equal(a, b) for a, b in zip(tree_leaves(params), tree_leaves(trained))]
    assert sum(changed) >= len(LeafLayout(params).trainable) - 1
