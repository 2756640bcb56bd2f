"""The engine under data-parallel attention over gloo: two ranks' greedy tokens equal one process's.

Each rank loads the model with `Parallel(data_parallel_attention=True)` (with and without expert
parallelism; tiny V3 and V4) and runs the same `Engine` calls: five prompts of different lengths and
lengths to generate (an odd count, so the ranks' loads differ; chunked prefills and mixed steps;
one rank runs out of requests while the other has some), then one prompt alone (the other rank idle
every step), a prompt scored on every rank, and a request for logprobs, which is refused.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from mla_func.serving.rank_scheduler import RankSchedulers
from mla_func.serving.scheduler import Request
from mla_func.serving.scheduler_types import SchedulerConfig
from mla_func.state.layer_cache import CacheGroup
from support.mla_reference import make_reference, rel_err, save_reference
from support.parallel_jobs import MAX_TOKENS, engine_run, job_engine, runs_of_every_rank
from support.parallel_runs import TOL, WORLD
from support.v4_reference import save_reference as save_v4

# name -> (checkpoint, expert_parallel)
RUNS = {"v3-dp": ("v3", False), "v3-dp-ep": ("v3", True), "v4-dp": ("v4", False)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-engine")
    save_reference(make_reference("v3-qlora-noaux", seed=21, vocab_size=98), root / "v3")
    save_v4(root / "v4", seed=22, vocab_size=98)
    return {"v3": root / "v3", "v4": root / "v4"}


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """{run: [what each rank's engine gave]}, from one spawned group for every run."""
    runs = {name: (str(folders[checkpoint]), expert_parallel) for name, (checkpoint, expert_parallel) in RUNS.items()}
    return runs_of_every_rank(job_engine, runs, tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def whole(folders):
    return {name: engine_run(mf.load_model(path, dtype=torch.float32, device="cpu")) for name, path in folders.items()}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_rank_returns_one_process_greedy_tokens(sharded, whole, run):
    want = whole[RUNS[run][0]]
    assert [len(tokens) for tokens in want["many"]] == list(MAX_TOKENS) and len(want["one"]) == 1
    assert len(want["one"][0]) == MAX_TOKENS[2]
    for rank in range(WORLD):
        got = sharded[run][rank]
        assert got["many"] == want["many"], f"rank {rank}"
        assert got["one"] == want["one"], f"rank {rank}"
        # Steps where a rank had no request: the single prompt's, and the end of the five prompts'.
        assert got["steps"] > got["idle_steps"] > len(want["one"][0]), f"rank {rank}"


@pytest.mark.parametrize("run", sorted(RUNS))
def test_a_prompt_scored_on_every_rank_equals_one_process(sharded, whole, run):
    want = whole[RUNS[run][0]]["score"]
    for rank in range(WORLD):
        got = sharded[run][rank]["score"]
        assert got.shape == want.shape and rel_err(got, want) <= TOL, f"rank {rank}"


def test_logprobs_are_refused_by_name(sharded, whole):
    assert whole["v3"]["logprobs_error"] is None
    for rank in range(WORLD):
        error = sharded["v3-dp"][rank]["logprobs_error"]
        assert error is not None and "SamplingParams.logprobs 1 is not supported under data-parallel attention" in error


def test_requests_go_to_the_least_loaded_rank_alike_on_every_rank():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
                             cache_groups=(CacheGroup(num_blocks=32, block_size=4),))
    every_rank = [RankSchedulers(config, 3, rank) for rank in range(3)]
    for schedulers in every_rank:
        for i in range(5):
            schedulers.add(Request(i, (1, 2, 3), max_tokens=4))
        assert [schedulers.owner(i) for i in range(5)] == [0, 1, 2, 0, 1]  # round robin when added together
        schedulers.finish(2)
        schedulers.finish(0)
        schedulers.add(Request(5, (1, 2), max_tokens=4))                   # rank 2 now holds none
        schedulers.add(Request(6, (1, 2), max_tokens=4))                   # ranks 0 and 2 hold one: the lowest
        assert (schedulers.owner(5), schedulers.owner(6)) == (2, 0)
    steps = [schedulers.schedule() for schedulers in every_rank]
    assert all(s is not None for s in steps)
    # Every rank plans every rank's step alike, and knows which is its own.
    assert len({s.plans for s in steps}) == 1 and len({s.request_ids for s in steps}) == 1
    assert [s.own is s.steps[rank] for rank, s in enumerate(steps)] == [True] * 3
