"""Cache bytes a sequence holds and the contexts that fit (`mla_func.core.cache_budget`), against real states.

The budget is measured on the meta device; these tests allocate the same states for real (a few blocks
of tiny shapes) and check every byte: the total, each group's bytes a block, and a sequence's bytes at
T tokens counted leaf by leaf from the blocks the scheduler's own allocator hands out and keeps (a
bounded group 0 frees what lies behind its lookback). V4's bytes a token at long context are checked
against the design's formula, computed here from the config alone.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import torch

import mla_func as mf
from mla_func.core.cache_budget import CacheBudget, cache_budget
from mla_func.core.config import ModelConfig
from mla_func.models.dsa.family import DSA
from mla_func.models.presets import tiny, v2_lite, v32_lite, v4_mini, v4_tiny
from mla_func.models.v4.config import CSA, HCA, SLIDING, v4_fields
from mla_func.serving.engine_config import default_num_blocks
from mla_func.state.block_allocator import SCRATCH_BLOCK
from mla_func.state.cache_groups import GroupedAllocator
from mla_func.state.layer_cache import CacheGroup
from mla_func.state.v4_cache import V4LayerCache

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_cache_budget", ROOT / "bench" / "cache_budget.py")
bench_cache_budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_cache_budget)


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
@pytest.mark.parametrize("block_size,num_blocks,limits", [(1, 2, None), (4, 3, None), (16, 5, None), (32, 2, None),
                                                          (4, 40, (2, 8)), (16, 9, (1, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_budget_is_the_bytes_of_a_real_state(name, block_size, num_blocks, limits, dtype):
    config = CONFIGS[name]()
    seqs, step = limits or (None, None)
    budget = cache_budget(config, dtype=dtype, block_size=block_size, num_blocks=num_blocks, max_num_seqs=seqs,
                          max_num_batched_tokens=step)
    state = mf.init_state(config, num_blocks=num_blocks, block_size=block_size, dtype=dtype, max_num_seqs=seqs,
                          max_num_batched_tokens=step)
    assert budget.groups == state.groups
    allocated = sum(t.nbytes for t in state.leaves())
    assert budget.total_bytes == allocated
    assert list(budget.bytes_per_block) == group_bytes_per_block(state)
    # Each group counts every leaf paged by its tables, whichever group its layer is in (V4's entries too).
    assert [state.bytes_per_block(g) for g in range(len(state.groups))] == list(budget.bytes_per_block)


def test_each_group_is_sized_by_its_own_rate():
    """num_blocks is a capacity in tokens: each compressed group holds those tokens' entries (one block a
    sequence more, given max_num_seqs), and V4's bounded group 0 only what max_num_seqs sequences and a
    step's tokens hold at once."""
    config = v4_tiny()
    lookback = 15   # window 8 - 1, CSA 2 * 4 - 1, HCA 16 - 1
    plain = mf.init_state(config, num_blocks=101, block_size=4, device="meta")
    assert [(g.num_blocks, g.block_size, g.tokens_per_entry, g.lookback) for g in plain.groups] == [
        (101, 4, 1, lookback), (101, 1, 4, None), (26, 1, 16, None)]
    engine = mf.init_state(config, num_blocks=101, block_size=4, device="meta", max_num_seqs=3,
                           max_num_batched_tokens=10)
    in_flight = 1 + 3 * (-(-lookback // 4) + 2) + -(-10 // 4)
    assert [g.num_blocks for g in engine.groups] == [in_flight, 101 + 3, 26 + 3] and in_flight == 22
    # A model that reads every token keeps num_blocks in group 0.
    assert mf.init_state(tiny(), num_blocks=101, block_size=4, device="meta", max_num_seqs=3,
                         max_num_batched_tokens=10).groups == (CacheGroup(101, 4),)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_sequence_holds_the_blocks_the_allocator_hands_it(name):
    config = CONFIGS[name]()
    budget = cache_budget(config, dtype=torch.float32, block_size=4, num_blocks=64)
    allocator = GroupedAllocator(budget.groups, enable_prefix_caching=False)
    for context in (1, 3, 4, 5, 16, 17, 63, 64, 65, 100):
        tables = allocator.empty_tables()
        allocator.allocate(tables, allocator.blocks_needed(tables, context))
        allocator.free_behind(tables, context)   # what the scheduler keeps once the step is done
        held_blocks = tuple(sum(b != SCRATCH_BLOCK for b in t) for t in tables)
        held = sum(n * b for n, b in zip(held_blocks, budget.bytes_per_block))
        assert budget.blocks(context) == held_blocks
        assert budget.sequence_bytes(context) == held
        assert budget.bytes_per_token(context) == held / context
        assert budget.peak_bytes(context) == max(budget.sequence_bytes(t) for t in range(context + 1))
        allocator.free(tables)
        allocator.check_invariants([{}] * len(tables))


def test_v4_bytes_a_token_fall_with_the_context_as_group_0_keeps_only_its_lookback():
    budget = cache_budget(v4_tiny(), dtype=torch.bfloat16, block_size=16)
    assert budget.groups[0].lookback == 15
    # A compressed entry is written by the last of its tokens: 3 tokens hold none, 4 hold CSA's first.
    assert budget.blocks(3) == (1, 0, 0) and budget.blocks(4) == (1, 1, 0) and budget.blocks(16) == (1, 1, 1)
    assert budget.bytes_per_token(4) != budget.bytes_per_token(3)
    # Group 0 holds the blocks of the last 15 tokens (one or two of 16) at any length.
    assert {budget.blocks(t)[0] for t in range(16, 4096)} == {1, 2}
    assert budget.groups[0].peak_blocks(1 << 20) == budget.groups[0].peak_blocks(30) == 2
    assert budget.blocks(1 << 20)[0] == budget.blocks(1 << 16)[0] == 1
    assert budget.bytes_per_token(1 << 20) < budget.bytes_per_token(1 << 16) < budget.bytes_per_token(1 << 12)
    entries = sum(b / g.tokens_per_block for g, b in zip(budget.groups[1:], budget.bytes_per_block[1:]))
    assert budget.bytes_per_token(1 << 20) == pytest.approx(entries, rel=1e-3)


def v4_formula_bytes_per_token(config, context: int, itemsize: int = 2) -> float:
    """The design's cache a token of a V4 model at `context` tokens, from its config alone: per layer the
    window's keys, the compressor inputs of the block being filled (CSA: and the previous one, with its
    indexer's), the compressed entries and the indexer keys."""
    v = v4_fields(config)
    dh, di, window = v.head_dim, v.index_head_dim, v.sliding_window
    total = 0
    for kind in v.layer_types:
        total += window * dh
        if kind == SLIDING:
            continue
        rate = v.rate(kind)
        entries = context // rate
        if kind == CSA:
            total += 2 * rate * (2 * 2 * dh + 4 * di) + entries * (dh + di)
        else:
            assert kind == HCA
            total += rate * 2 * dh + entries * dh
    return total * itemsize / context


@pytest.mark.parametrize("make", [v4_mini, bench_cache_budget.v4_flash_layout], ids=["v4-mini", "v4-flash-layout"])
@pytest.mark.parametrize("context", [1 << 16, 1 << 20])
def test_v4_bytes_a_token_at_long_context_are_the_designs(make, context):
    config = make()
    got = cache_budget(config, dtype=torch.bfloat16, block_size=16).bytes_per_token(context)
    want = v4_formula_bytes_per_token(config, context)
    assert want * 0.9 <= got <= want * 1.1, (got, want)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_longest_context_fits_and_one_more_token_does_not(name, dtype):
    budget = cache_budget(CONFIGS[name](), dtype=dtype, block_size=16)
    for budget_bytes in (budget.sequence_bytes(1), 10_000, 123_456, 1 << 20, 7 << 30):
        longest = budget.longest_context(budget_bytes)
        assert (longest >= 1) == (budget_bytes >= budget.sequence_bytes(1))
        # What a sequence holds on its way there (group 0's blocks rise and fall where it is bounded).
        assert budget.peak_bytes(longest) <= budget_bytes < budget.peak_bytes(longest + 1)
        assert budget.peak_bytes(longest + 16) > budget_bytes
        assert all(budget.sequence_bytes(t) <= budget_bytes for t in range(max(0, longest - 64), longest + 1))
    assert budget.longest_context(budget.sequence_bytes(1) - 1) == 0
    assert budget.longest_context(0) == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_sequences_that_fit(name):
    budget = cache_budget(CONFIGS[name](), dtype=torch.bfloat16, block_size=16)
    for context, budget_bytes in ((1, 1 << 20), (100, 1 << 20), (4096, 1 << 30), (4096, 0)):
        n = budget.sequences_that_fit(context, budget_bytes)
        need = budget.peak_bytes(context)
        assert n * need <= budget_bytes < (n + 1) * need and need >= budget.sequence_bytes(context)


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
    groups = engine.state.groups
    if preset == "tiny":
        assert report.longest_context == engine.scheduler.blocks.num_usable_tokens() == 16 * 4
        assert report.sequences == 16 // 6  # 24 tokens take 6 blocks of 4 in group 0
    else:
        # Group 0 keeps 15 tokens behind: 4 sequences and a step of 64 tokens would take 1 + 4 * (4 + 2) + 16
        # blocks, more than its 17. CSA's entries (one a block of 4 tokens) hold 64 tokens, and one block more
        # a sequence: the scarcest group.
        assert [g.num_blocks for g in groups] == [17, 17 + 4, 5 + 4]
        assert report.longest_context == engine.scheduler.blocks.num_usable_tokens() == 20 * 4 + 3
        assert report.sequences == min(16 // 5, 20 // 6, 8 // 1)   # 24 tokens: at most 5, 6 and 1 blocks
    assert engine.cache_report().context == 64
    with pytest.raises(ValueError, match="context must be an int >= 1, got 0"):
        engine.cache_report(context=0)


@pytest.mark.parametrize("limits", [None, (64, 2048)])
def test_the_engine_budgets_every_cache_group(limits):
    """`default_num_blocks` takes the most blocks whose state, every group sized on its own (V4's compressed
    groups and its bounded group 0 included), fits its memory budget."""
    model = mf.load_model("v4-tiny", device="cpu")
    seqs, step = limits or (1 << 20, None)
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8

    def state_bytes(num_blocks):
        return cache_budget(model.config, dtype=model.dtype, block_size=16, num_blocks=num_blocks,
                            max_num_seqs=None if step is None else seqs, max_num_batched_tokens=step).total_bytes

    n = default_num_blocks(model, 16, max_num_seqs=seqs, max_model_len=1 << 20, max_num_batched_tokens=step)
    assert state_bytes(n) <= budget < state_bytes(n + 1)
