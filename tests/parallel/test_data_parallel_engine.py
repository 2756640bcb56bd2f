"""The engine under data-parallel attention over gloo: two ranks' greedy tokens equal one process's.

Each rank loads the model with `Parallel(data_parallel_attention=True)` (with and without expert
parallelism; tiny V3 and V4) and runs the same `Engine` calls: five prompts of different lengths and
lengths to generate (an odd count, so the ranks' loads differ; chunked prefills and mixed steps;
one rank runs out of requests while the other has some), then one prompt alone (the other rank idle
every step), a prompt scored on every rank, and requests for logprobs (greedy and seeded sampling, one
with prompt_logprobs, one without logprobs; rank 1 idles at their end), whose logprobs every rank returns.
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
from support.parallel_jobs import LOGPROBS_REQUESTS, MAX_TOKENS, engine_run, job_engine, runs_of_every_rank
from support.parallel_runs import TOL, WORLD
from support.v4_reference import save_reference as save_v4

# name -> (checkpoint, expert_parallel)
RUNS = {"v3-dp": ("v3", False), "v3-dp-ep": ("v3", True), "v4-dp": ("v4", False)}
# fp32 logprobs (a few units in magnitude) against one process's, relative: the logits differ in their last bits
# (the ranks' partial sums add up in another order, `TOL`), which moves a logprob by up to about ten units in its
# last place (2.4e-6 absolute, 8.8e-7 relative at most on these runs), so they are not exactly one process's;
# the bound is the logits' own (`TOL`), with room for other CPUs' orders.
LOGPROB_TOL = TOL


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


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_rank_returns_one_process_logprobs(sharded, whole, run):
    want = whole[RUNS[run][0]]["logprobs"]
    assert [w["error"] for w in want] == [None] * len(LOGPROBS_REQUESTS)
    assert [len(w["logprobs"] or ()) for w in want] == [kw["max_tokens"] if "logprobs" in kw else 0
                                                        for _, kw in LOGPROBS_REQUESTS]
    ranks = [sharded[run][rank]["logprobs"] for rank in range(WORLD)]
    # Each row's logprobs are gathered with its token and recorded alike on every rank: equal bit for bit.
    # (Prompt logprobs are scored on every rank, each within LOGPROB_TOL of one process's.)
    assert all([g["logprobs"] for g in got] == [g["logprobs"] for g in ranks[0]] for got in ranks[1:])
    for rank, got in enumerate(ranks):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g["error"] is None and g["tokens"] == w["tokens"], f"rank {rank} request {i}"
            for name in ("logprobs", "prompt_logprobs"):
                assert (g[name] is None) == (w[name] is None), f"rank {rank} request {i} {name}"
                for position, (a, b) in enumerate(zip(g[name] or (), w[name] or (), strict=True)):
                    _assert_close(a, b, f"rank {rank} request {i} {name}[{position}]")


def _assert_close(got, want, where):
    """One token's (logprob, ((top id, logprob), ...)), or None, against one process's: the same ids, each
    logprob within LOGPROB_TOL of it relatively."""
    if got is None or want is None:
        assert got is None and want is None, where
        return
    assert [t for t, _ in got[1]] == [t for t, _ in want[1]], where
    for x, y in zip([got[0], *(v for _, v in got[1])], [want[0], *(v for _, v in want[1])], strict=True):
        assert abs(x - y) <= LOGPROB_TOL * abs(y), f"{where}: {x} against {y}"


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
