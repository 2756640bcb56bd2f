"""Cache bytes a sequence holds and the contexts that fit (`mla_func.core.cache_budget`), against real states.

The budget is measured on the meta device; these tests allocate the same states for real (a few blocks
of tiny shapes) and check every byte: the total, each group's bytes a block, and a sequence's bytes at
T tokens counted leaf by leaf from the blocks the scheduler's own allocator hands out.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import mla_func as mf
from mla_func.core.cache_budget import CacheBudget, cache_budget
from mla_func.core.config import ModelConfig
from mla_func.models.dsa.family import DSA
from mla_func.models.presets import tiny, v2_lite, v32_lite, v4_mini, v4_tiny
from mla_func.serving.engine_config import default_num_blocks
from mla_func.state.cache_groups import GroupedAllocator
from mla_func.state.layer_cache import CacheGroup
from mla_func.state.v4_cache import V4LayerCache


def v32_tiny() -> ModelConfig:
    """tiny's layers with V3.2's sparse attention: a small indexer beside the latents."""
    return dataclasses.replace(tiny(), family=DSA, model_type="deepseek_v32", index_n_heads=4, index_head_dim=24,
                               index_topk=8)


CONFIGS = {"v3": tiny, "v32": v32_tiny, "v4": v4_tiny}


def group_bytes_per_block(state: mf.KVCacheState) -> list[int]:
    """Each group's bytes a block, read from the allocated leaves (V4's entries sit in their own group)."""
    per_group = [0] * len(state.groups)
    for layer in state.layers:
        for t in layer.paged():
            per_group[layer.group] += t[0].nbytes
        if isinstance(layer, V4LayerCache):
            for t in layer.paged_entries():
                per_group[layer.entry_group] += t[0].nbytes
    return per_group


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("block_size,num_blocks", [(1, 2), (4, 3), (16, 5), (32, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_budget_is_the_bytes_of_a_real_state(name, block_size, num_blocks, dtype):
    config = CONFIGS[name]()
    budget = cache_budget(config, dtype=dtype, block_size=block_size, num_blocks=num_blocks)
    state = mf.init_state(config, num_blocks=num_blocks, block_size=block_size, dtype=dtype)
    assert budget.groups == state.groups
    allocated = sum(t.nbytes for t in state.leaves())
    assert budget.total_bytes == allocated
    assert sum(budget.bytes_per_block) == allocated // num_blocks  # every group has num_blocks blocks
    assert list(budget.bytes_per_block) == group_bytes_per_block(state)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_sequence_holds_the_blocks_the_allocator_hands_it(name):
    config = CONFIGS[name]()
    budget = cache_budget(config, dtype=torch.float32, block_size=4, num_blocks=64)
    allocator = GroupedAllocator(budget.groups, enable_prefix_caching=False)
    for context in (1, 3, 4, 5, 16, 17, 63, 64, 65, 100):
        tables = allocator.empty_tables()
        allocator.allocate(tables, allocator.blocks_needed(tables, context))
        held = sum(len(t) * b for t, b in zip(tables, budget.bytes_per_block))
        assert budget.blocks(context) == tuple(len(t) for t in tables)
        assert budget.sequence_bytes(context) == held
        assert budget.bytes_per_token(context) == held / context
        allocator.free(tables)


def test_v4_bytes_a_token_vary_with_the_context_but_group_0_keeps_every_token():
    budget = cache_budget(v4_tiny(), dtype=torch.bfloat16, block_size=16)
    # A compressed entry is written by the last of its tokens: 3 tokens hold none, 4 hold CSA's first.
    assert budget.blocks(3) == (1, 0, 0) and budget.blocks(4) == (1, 1, 0) and budget.blocks(16) == (1, 1, 1)
    assert budget.bytes_per_token(4) != budget.bytes_per_token(3)
    # Past the window, bytes a token do not fall: group 0 holds every token's leaves.
    assert budget.bytes_per_token(1 << 20) >= budget.bytes_per_block[0] / 16


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_longest_context_fits_and_one_more_token_does_not(name, dtype):
    budget = cache_budget(CONFIGS[name](), dtype=dtype, block_size=16)
    for budget_bytes in (budget.sequence_bytes(1), 10_000, 123_456, 1 << 20, 7 << 30):
        longest = budget.longest_context(budget_bytes)
        assert (longest >= 1) == (budget_bytes >= budget.sequence_bytes(1))
        assert budget.sequence_bytes(longest) <= budget_bytes < budget.sequence_bytes(longest + 1)
        assert budget.sequence_bytes(longest + 16) > budget_bytes
    assert budget.longest_context(budget.sequence_bytes(1) - 1) == 0
    assert budget.longest_context(0) == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_sequences_that_fit(name):
    budget = cache_budget(CONFIGS[name](), dtype=torch.bfloat16, block_size=16)
    for context, budget_bytes in ((1, 1 << 20), (100, 1 << 20), (4096, 1 << 30), (4096, 0)):
        n = budget.sequences_that_fit(context, budget_bytes)
        need = budget.sequence_bytes(context)
        assert n * need <= budget_bytes < (n + 1) * need


@pytest.mark.parametrize("name", CONFIGS)
def test_a_state_s_blocks_match_its_allocator(name):
    budget = cache_budget(CONFIGS[name](), dtype=torch.float32, block_size=4, num_blocks=33)
    allocator = GroupedAllocator(budget.groups)
    assert budget.longest_context_in_blocks() == allocator.num_usable_tokens()
    report = budget.report(20)
    assert report.longest_context == allocator.num_usable_tokens()
    assert report.blocks == budget.blocks(20) and report.sequence_bytes == budget.sequence_bytes(20)
    # As many sequences of 20 tokens as the scarcest group's usable blocks take.
    tables = [allocator.empty_tables() for _ in range(report.sequences)]
    for t in tables:
        allocator.allocate(t, allocator.blocks_needed(t, 20))
    extra = allocator.empty_tables()
    assert not allocator.can_allocate(allocator.blocks_needed(extra, 20))


def test_the_planning_shapes_are_measured_without_memory():
    # The real shapes give their bytes without allocating any (meta device): V3-style latents of 512 + 64,
    # V3.2's indexer keys of 128 more, v4-mini's four layers (SWA, CSA, HCA, CSA).
    bf16 = torch.bfloat16
    assert cache_budget(v2_lite(), dtype=bf16).bytes_per_token(1 << 16) == 27 * 576 * 2
    assert cache_budget(v32_lite(), dtype=bf16).bytes_per_token(1 << 16) == 27 * (576 + 128) * 2
    budget = cache_budget(v4_mini(), dtype=bf16)
    assert [g.tokens_per_entry for g in budget.groups] == [1, 4, 128]
    window, csa_inputs, hca_inputs, index_inputs = 512, 2 * 2 * 512, 2 * 512, 4 * 128
    assert budget.bytes_per_block[0] == 16 * 2 * (4 * window + 2 * (csa_inputs + index_inputs) + hca_inputs)
    assert budget.bytes_per_block[1] == 4 * 2 * 2 * (512 + 128)   # two CSA layers' entries and index keys
    assert budget.bytes_per_block[2] == 1 * 2 * 512                # one HCA layer's entries


def test_bad_values_are_refused_by_name():
    group = CacheGroup(num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match=r"bytes_per_block: expected one per group \(1\)"):
        CacheBudget(groups=(group,), bytes_per_block=(1, 2))
    with pytest.raises(ValueError, match=r"bytes_per_block\[0\]: group 0 must cost bytes"):
        CacheBudget(groups=(group,), bytes_per_block=(0,))
    budget = CacheBudget(groups=(group,), bytes_per_block=(16,))
    with pytest.raises(ValueError, match="context: expected an int >= 1, got 0"):
        budget.bytes_per_token(0)
    with pytest.raises(ValueError, match="budget_bytes: expected an int >= 0, got -1"):
        budget.longest_context(-1)
    with pytest.raises(ValueError, match="num_blocks: expected an int >= 2, got 1"):
        cache_budget(tiny(), dtype=torch.float32, num_blocks=1)


@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_the_engine_reports_its_own_cache(preset):
    engine = mf.Engine(mf.load_model(preset, device="cpu"), num_blocks=17, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=64, graphs=False)
    budget = engine.cache_budget
    assert budget.groups == engine.state.groups
    assert budget.total_bytes == sum(t.nbytes for t in engine.state.leaves())
    report = engine.cache_report(context=24)
    assert report.longest_context == engine.scheduler.blocks.num_usable_tokens() == 16 * 4
    assert report.sequences == 16 // 6  # 24 tokens take 6 blocks of 4 in group 0, the scarcest
    assert engine.cache_report().context == 64
    with pytest.raises(ValueError, match="context must be an int >= 1, got 0"):
        engine.cache_report(context=0)


def test_the_engine_budgets_a_block_of_every_cache_group():
    """`default_num_blocks` divides its memory budget by what one block of every group costs (V4's
    compressed groups included), so the state it sizes fits the budget."""
    model = mf.load_model("v4-tiny", device="cpu")
    per_group = cache_budget(model.config, dtype=model.dtype, block_size=16).bytes_per_block
    assert len(per_group) > 1 and all(b > 0 for b in per_group)
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    assert default_num_blocks(model, 16, max_num_seqs=1 << 30, max_model_len=1 << 20) == budget // sum(per_group)
