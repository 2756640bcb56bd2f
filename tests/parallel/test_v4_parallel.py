"""DeepSeek-V4 under tensor, expert and data-parallel attention over gloo: two ranks equal one process.

One tiny V4 checkpoint, written by transformers' `save_pretrained` (window, CSA and HCA layers,
hash-routed and learned top-k MoE layers, a shared expert, hyper-connections), with an even
vocabulary so the embedding and LM head are split too. One group of two spawned processes runs
it in every mode (`support.parallel_runs`); this process runs the same on the whole model.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from mla_func.core.config import ConfigError
from mla_func.parallel.config import Sharding
from support.mla_reference import rel_err
from support.parallel_runs import (DP_MODES, MODES, STEP_KINDS, TOL, TP_MODES, WORLD, held, rank_steps, run_steps,
                                   scenarios, spawn_group)
from support.v4_reference import save_reference


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    save_reference(path, seed=31, vocab_size=98)
    return path


@pytest.fixture(scope="module")
def whole(folder):
    model = mf.load_model(folder, dtype=torch.float32, device="cpu")
    return model, {**scenarios(model), "held": held(model)}


@pytest.fixture(scope="module")
def sharded(folder, tmp_path_factory):
    """{mode: [what each rank saved]}, from one spawned group for every mode."""
    runs = {mode: (str(folder), *flags) for mode, flags in MODES.items()}
    results = spawn_group("scenarios", WORLD, tmp_path_factory.mktemp("ranks"), args=tuple(runs.values()))
    assert sorted(results) == list(range(WORLD)), f"ranks that saved nothing: {set(range(WORLD)) - set(results)}"
    for rank, result in results.items():
        assert "raised" not in result, f"rank {rank}: {result.get('traceback')}"
    return {mode: [results[r][run] for r in range(WORLD)] for mode, run in runs.items()}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_rank_holds_its_share(sharded, whole, mode):
    model, results = whole
    full = results["held"]
    expert_parallel, data_parallel = MODES[mode]
    for rank in range(WORLD):
        share = sharded[mode][rank]["held"]
        assert share["heads"] == (full["heads"] if data_parallel else full["heads"] // WORLD)
        assert share["vocab_rows"] == (full["vocab_rows"] if data_parallel else full["vocab_rows"] // WORLD)
        # Expert parallel: half of the routed experts whole; otherwise every expert (shared last) by columns.
        assert share["experts"] == (model.config.n_routed_experts // WORLD if expert_parallel else full["experts"])
        assert share["elements"] < full["elements"]


@pytest.mark.parametrize("kind", STEP_KINDS)
@pytest.mark.parametrize("mode", TP_MODES)
def test_sharded_logits_equal_one_process(sharded, whole, mode, kind):
    want = whole[1][kind]
    ranks = sharded[mode]
    for rank, got in enumerate(ranks):
        assert got[kind].shape == want.shape
        assert rel_err(got[kind], want) <= TOL, f"rank {rank}"
    # The all-reduce gives every rank the same bits, so sampling agrees across ranks by construction.
    assert all(torch.equal(r[kind], ranks[0][kind]) for r in ranks)


@pytest.mark.parametrize("mode", TP_MODES)
def test_engine_greedy_tokens_equal_one_process(sharded, whole, mode):
    want = whole[1]["greedy"]
    assert all(len(tokens) == 6 for tokens in want)
    for rank in range(WORLD):
        assert sharded[mode][rank]["greedy"] == want, f"rank {rank}"


@pytest.mark.parametrize("mode", DP_MODES)
def test_data_parallel_attention_equals_each_rank_alone(sharded, whole, mode):
    """Each rank runs its own requests (other lengths than the other rank's: the exchange pads, and the
    hash-routed layers read the token ids that came with the rows), each equal to its requests alone."""
    model, _ = whole
    for rank in range(WORLD):
        alone = run_steps(model, rank_steps(model, rank))
        got = sharded[mode][rank]["steps"]
        assert len(got) == len(alone)
        for step, (g, want) in enumerate(zip(got, alone)):
            assert g.shape == want.shape and rel_err(g, want) <= TOL, f"rank {rank}, step {step}"


def test_a_split_the_config_does_not_allow_is_refused_by_name(folder):
    config = mf.read_config(folder / "config.json")
    split, experts = config.family.tensor_split, config.family.expert_parallel_params
    assert split is not None and experts is not None
    # 4 heads in 2 output groups: 4 ranks would split a group of heads.
    with pytest.raises(ConfigError, match=r"'o_groups' = 2.*whole groups.*num_attention_heads=4 in 2 groups.*multiple of 4"):
        split(config, Sharding(4))
    with pytest.raises(ConfigError, match="num_attention_heads.*multiple of 3"):
        split(config, Sharding(3))
    # Data-parallel attention keeps every head on every rank: only the expert widths must divide.
    split(config, Sharding(4, data_parallel_attention=True))
    with pytest.raises(ConfigError, match="moe_intermediate_size.*multiple of 3"):
        split(config, Sharding(3, data_parallel_attention=True))

    def fetch(name):
        raise AssertionError(f"read {name} before the expert count was checked")

    with pytest.raises(ConfigError, match="n_routed_experts.*whole experts.*multiple of 3"):
        experts(config, fetch, rank=0, ranks=3, dtype=torch.float32, device="cpu")
