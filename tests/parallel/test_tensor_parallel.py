"""Tensor and expert parallelism over gloo: two ranks' logits equal one process's on every step kind.

One group of two spawned processes runs every checkpoint (tiny V3 with and without a low-rank
query, tiny V3.2), tensor-parallel and expert-parallel, through `scenarios`; this process runs the
same on the whole model. Then a rank that dies and a rank that never joins must each give the
others an error, never a hang.
"""

from __future__ import annotations

import time

import pytest
import torch

import mla_func as mf
from mla_func.core.config import ConfigError
from mla_func.parallel import Parallel
from mla_func.parallel.config import Sharding
from support.dsa_reference import make_v32
from support.mla_reference import make_reference, rel_err, save_reference
from support.parallel_runs import (DP_MODES, MODES, STEP_KINDS, TOL, TP_MODES, WORLD, held, rank_steps, run_steps,
                                   scenarios, spawn_group)
from support.symmetric_jobs import gloo_symmetric_choice

CHECKPOINTS = {
    # An even vocabulary: the embedding and LM head are split too (97, the others', is held whole).
    "v3-qlora": lambda: make_reference("v3-qlora-noaux", seed=11, vocab_size=98),
    "v3-no-qlora": lambda: make_reference("v3-yarn-halfsplit", seed=12),
    "v32": lambda: make_v32(seed=13),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: save_reference(make(), tmp_path_factory.mktemp(name)) for name, make in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """{(checkpoint name, mode): [scenarios of each rank]}, from one spawned group for all of them."""
    out = tmp_path_factory.mktemp("ranks")
    runs = {(name, mode): (str(path), *flags) for name, path in folders.items() for mode, flags in MODES.items()}
    results = spawn_group("scenarios", WORLD, out, args=tuple(runs.values()))
    assert sorted(results) == list(range(WORLD)), f"ranks that saved nothing: {set(range(WORLD)) - set(results)}"
    for rank, result in results.items():
        assert "raised" not in result, f"rank {rank}: {result.get('traceback')}"
    return {key: [results[r][run] for r in range(WORLD)] for key, run in runs.items()}


@pytest.fixture(scope="module")
def whole(folders):
    results = {}
    for name, path in folders.items():
        model = mf.load_model(path, dtype=torch.float32, device="cpu")
        results[name] = {**scenarios(model), "held": held(model)}
    return results


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_each_rank_holds_its_share(sharded, whole, folders, checkpoint, mode):
    full = whole[checkpoint]["held"]
    routed = mf.read_config(folders[checkpoint] / "config.json").n_routed_experts
    for rank in range(WORLD):
        share = sharded[checkpoint, mode][rank]["held"]
        expert_parallel, data_parallel = MODES[mode]
        # Data-parallel attention: every head, and the whole embedding, on every rank.
        assert share["heads"] == (full["heads"] if data_parallel else full["heads"] // WORLD)
        assert share["elements"] < full["elements"]
        vocab = full["vocab_rows"]
        assert share["vocab_rows"] == (vocab // WORLD if vocab % WORLD == 0 and not data_parallel else vocab)
        # Expert parallel: whole routed experts, half of them; otherwise every expert's columns.
        assert share["experts"] == (routed // WORLD if expert_parallel else full["experts"])


@pytest.mark.parametrize("kind", STEP_KINDS)
@pytest.mark.parametrize("mode", TP_MODES)
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_sharded_logits_equal_one_process(sharded, whole, checkpoint, mode, kind):
    want = whole[checkpoint][kind]
    ranks = sharded[checkpoint, mode]
    for rank, got in enumerate(ranks):
        assert got[kind].shape == want.shape
        assert rel_err(got[kind], want) <= TOL, f"rank {rank}"
    # The all-reduce gives every rank the same bits, so sampling agrees across ranks by construction.
    assert all(torch.equal(r[kind], ranks[0][kind]) for r in ranks)


@pytest.mark.parametrize("mode", TP_MODES)
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_engine_greedy_tokens_equal_one_process(sharded, whole, checkpoint, mode):
    want = whole[checkpoint]["greedy"]
    assert all(len(tokens) == 6 for tokens in want)
    for rank in range(WORLD):
        assert sharded[checkpoint, mode][rank]["greedy"] == want, f"rank {rank}"


@pytest.mark.parametrize("mode", DP_MODES)
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_data_parallel_attention_equals_each_rank_alone(sharded, folders, checkpoint, mode):
    """Each rank runs its own requests (of other lengths than the other rank's: the exchange pads),
    through prefill, decode, mixed and verify steps; each equals its requests run by one process."""
    model = mf.load_model(folders[checkpoint], dtype=torch.float32, device="cpu")
    for rank in range(WORLD):
        alone = run_steps(model, rank_steps(model, rank))
        got = sharded[checkpoint, mode][rank]["steps"]
        assert len(got) == len(alone)
        for step, (g, want) in enumerate(zip(got, alone)):
            assert g.shape == want.shape and rel_err(g, want) <= TOL, f"rank {rank}, step {step}"


def test_a_rank_that_dies_fails_the_others_within_the_timeout(folders, tmp_path):
    timeout_s = 20.0
    results = spawn_group("die_before_step", WORLD, tmp_path, timeout_s=timeout_s, deadline_s=60.0,
                          args=(str(folders["v3-qlora"]),))
    assert 1 not in results  # it died without a word
    assert "raised" not in results[0], results[0].get("traceback")
    assert results[0]["error"] is not None and "all_reduce on rank 0 of 2" in results[0]["error"]
    assert results[0]["seconds"] < timeout_s


def test_a_rank_that_never_joins_fails_the_others_within_the_timeout(tmp_path):
    started = time.monotonic()
    results = spawn_group("scenarios", WORLD, tmp_path, ranks=(0,), timeout_s=3.0, deadline_s=60.0)
    assert "raised" in results[0] and "did not join within 3 s" in results[0]["raised"]
    assert time.monotonic() - started < 30.0


def test_a_config_the_ranks_cannot_split_is_refused(folders):
    config = mf.read_config(folders["v3-qlora"] / "config.json")
    split = config.family.tensor_split
    assert split is not None
    with pytest.raises(ConfigError, match="num_attention_heads.*multiple of 3"):
        split(config, Sharding(3))
    # Data-parallel attention keeps every head on every rank: only the MLP widths must divide.
    with pytest.raises(ConfigError, match="intermediate_size.*multiple of 3"):
        split(config, Sharding(3, data_parallel_attention=True))


def test_one_rank_is_the_unsharded_model(folders):
    path = folders["v3-qlora"]
    one = mf.load_model(path, dtype=torch.float32, device="cpu", parallel=Parallel())
    plain = mf.load_model(path, dtype=torch.float32, device="cpu")
    assert one.params.collectives is plain.params.collectives
    assert all(torch.equal(a, b) for a, b in zip(mf.pytree.tree_leaves(one.params), mf.pytree.tree_leaves(plain.params)))


def test_gloo_ranks_sum_through_gloo_and_refuse_symmetric_memory(tmp_path):
    results = spawn_group(gloo_symmetric_choice, WORLD, tmp_path)
    assert sorted(results) == list(range(WORLD))
    for rank, result in results.items():
        assert "raised" not in result, result.get("traceback")
        assert result["symmetric_memory"] is False and result["kind"] == "_GroupReduce", (rank, result)
        assert result["refusal"] is not None and "backend 'gloo'" in result["refusal"], (rank, result)


def test_symmetric_memory_needs_a_group_and_a_bool():
    with pytest.raises(ValueError, match="symmetric_memory needs the process group"):
        Parallel(symmetric_memory=True)
    with pytest.raises(ValueError, match="symmetric_memory must be a bool, got 1"):
        Parallel(symmetric_memory=1)
