"""The state against the model and the batch: defaults, dtype/device, block size, block ids, geometry."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mla_func as mf
from mla_func.state.kv_cache import KVCacheState
from mla_func.state.layer_cache import CacheGroup, MLALayerCache


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=51)


def test_init_state_takes_the_model_dtype_and_device(model):
    state = mf.init_state(model, num_blocks=8, block_size=4)
    assert (state.dtype, state.device.type) == (torch.float64, "cpu")
    assert all(isinstance(c, MLALayerCache) for c in state.layers)
    assert state.leaves()[0].shape == (8, 4, model.config.kv_cache_dim)
    assert mf.init_state(model.config, num_blocks=8, block_size=4).dtype == torch.float32


def test_a_state_of_another_dtype_is_refused_at_the_step(model):
    state = mf.init_state(model.config, num_blocks=8, block_size=4)  # float32: not the model's float64
    batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=(mf.SeqPlan((1, 2), 0, (1,)),)))
    with pytest.raises(ValueError, match=r"state is torch.float32 on cpu, the model torch.float64"):
        mf.forward(model.params, state, batch, mode)
    assert not state.is_donated


def test_a_batch_planned_for_another_block_size_is_refused(model):
    small = mf.init_state(model, num_blocks=16, block_size=4)
    large = mf.init_state(model, num_blocks=16, block_size=8)
    batch, mode = mf.plan_step(model.config, small, mf.StepPlan(prefill=(mf.SeqPlan((1, 2, 3, 4, 5), 0, (1, 2)),)))
    with pytest.raises(ValueError, match="planned for blocks of 4 tokens, the state's hold 8"):
        mf.forward(model.params, large, batch, mode)
    with pytest.raises(mf.BatchError, match="decided for blocks of 4 tokens, got 8"):
        mf.build_batch(mf.StepPlan(prefill=(mf.SeqPlan((1, 2, 3, 4, 5), 0, (1, 2)),)), mode, block_size=8,
                       device="cpu")


def test_make_step_checks_its_block_size_against_the_state(model):
    step = mf.make_step(model, block_size=16)
    state = mf.init_state(model, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="made for blocks of 16 tokens, the state's hold 4"):
        step.prepare(state, mf.StepPlan(prefill=(mf.SeqPlan((1,), 0, (1,)),)))


@pytest.mark.parametrize("table", [(1, -1), (-1,), (2, 16)])
def test_block_table_entries_outside_the_cache_are_refused(model, table):
    state = mf.init_state(model, num_blocks=16, block_size=4)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(range(1, 4 * len(table))), 0, table),))
    with pytest.raises(mf.BatchError, match=r"block ids must be in \[1, 16\)"):
        mf.plan_step(model.config, state, plan)
    # Without the state's block count (a hand-built batch), a negative id is still refused.
    if min(table) < 0:
        mode = mf.ForwardMode.decide(plan, cache_groups=state.groups)
        with pytest.raises(mf.BatchError, match="block ids must be in"):
            mf.build_batch(plan, mode, device="cpu")


def test_geometry_of_every_layer_is_checked():
    group = CacheGroup(num_blocks=4, block_size=2)
    good = MLALayerCache(kv=torch.zeros(4, 2, 8))
    bad = MLALayerCache(kv=torch.zeros(4, 3, 8))
    with pytest.raises(ValueError, match=r"layers\[1\]: a paged tensor of group 0 must start with"):
        KVCacheState.checked([good, bad], groups=[group])
    with pytest.raises(ValueError, match=r"layers\[0\].group: expected in \[0, 1\), got 1"):
        KVCacheState.checked([dataclasses.replace(good, group=1)], groups=[group])


def test_donation_and_copy_apply_to_every_leaf(model):
    state = mf.init_state(model, num_blocks=16, block_size=4)
    clone = mf.pytree.tree_map(torch.clone, state)
    assert not clone.is_donated and all(a is not b for a, b in zip(clone.leaves(), state.leaves()))
    batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=(mf.SeqPlan((1, 2), 0, (1,)),)))
    _, new = mf.forward(model.params, state, batch, mode)
    with pytest.raises(mf.DonatedStateError):
        state.check_live("again")
    renewed = new.renewed()
    assert [t.data_ptr() for t in renewed.leaves()] == [t.data_ptr() for t in new.leaves()]
    assert not renewed.is_donated


def test_bytes_per_block_follows_the_leaves(model):
    from mla_func.core.prepare import state_bytes_per_block

    c = model.config
    assert state_bytes_per_block(model, 16) == c.num_hidden_layers * 16 * c.kv_cache_dim * 8


def test_group_zero_holds_one_entry_per_token():
    with pytest.raises(ValueError, match=r"groups\[0\].tokens_per_entry: group 0 holds one entry per token, got 2"):
        KVCacheState.checked([MLALayerCache(kv=torch.zeros(4, 2, 8))], groups=[CacheGroup(4, 2, 2)])


def test_plan_step_checks_positions_against_the_rope_tables():
    """A model loaded with a shorter max_model_len has shorter RoPE tables; plan_step refuses past them."""
    model = mf.load_model("tiny", max_model_len=32)
    assert model.max_positions == 32 < model.config.max_position_embeddings
    state = mf.init_state(model.config, num_blocks=16, block_size=4, dtype=model.dtype, device=model.device)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(token_ids=(1, 2, 3), start_pos=30, block_table=tuple(range(1, 10))),))
    with pytest.raises(mf.BatchError, match="positions reach 32, the model's maximum is 31"):
        mf.plan_step(model.config, state, plan, max_position=model.max_positions)
    step = mf.make_step(model, graphs=False)
    with pytest.raises(mf.BatchError, match="positions reach 32"):
        step.prepare(state, plan)
