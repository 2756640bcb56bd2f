"""The engine under data-parallel attention replays CUDA graphs on two GPUs, every rank the same ones.

Two NCCL ranks, one GPU each, started by the library's launcher, each run the same engine calls on tiny
V3 (head dims of 16, the least the Triton prefill kernel takes) with `Parallel(data_parallel_attention=True)`,
in bf16 and fp32, with graphs (warmed up) and without: five prompts of other lengths (the ranks' loads
differ, and one rank runs out of requests first), then one prompt alone (the other rank idle every step).
A rank that captured a graph while the other replayed would hang the group, which meets its timeout.

* Every rank captured the same keys, all at warm-up (`rank_graph_modes` gives the keys real steps agree
  on), and replayed graphs at the same number of steps.
* fp32: the greedy tokens with graphs are those without (graphs pad steps to the ladders' rungs, which
  changes no result beyond rounding).
"""

from __future__ import annotations

import pytest
import torch

from support.mla_reference import make_reference, save_reference
from support.parallel_gpu_runs import DTYPES, nccl_group_results
from support.parallel_jobs import MAX_TOKENS, dp_graphs_rank
from support.parallel_runs import WORLD

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")]

TRITON_DIMS = dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """[what each rank saved: {dtype: {"graphs": ..., "eager": ...}} (`parallel_jobs.graph_engine_run`)]."""
    folder = tmp_path_factory.mktemp("dp-graphs-v3")
    save_reference(make_reference("v3-qlora-noaux", seed=11, vocab_size=98, **TRITON_DIMS), folder)
    out = tmp_path_factory.mktemp("dp-graphs-ranks")
    return nccl_group_results(dp_graphs_rank, (str(folder), str(out), tuple(DTYPES)), out)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_rank_replays_the_graphs_it_captured_at_warmup_alike(ranks, dtype):
    runs = [r[dtype]["graphs"] for r in ranks]
    for rank, run in enumerate(runs):
        assert run["warm_keys"], f"rank {rank}: warm-up captured nothing"
        assert run["keys"] == run["warm_keys"], f"rank {rank}: a step met a key warm-up did not capture"
        assert 0 < run["graph_steps"] < run["steps"], f"rank {rank}"  # prefill and mixed steps stay eager
    assert all(run["keys"] == runs[0]["keys"] for run in runs)
    assert all((run["steps"], run["graph_steps"]) == (runs[0]["steps"], runs[0]["graph_steps"]) for run in runs)
    # Every rank returns every completion.
    assert all((run["many"], run["one"]) == (runs[0]["many"], runs[0]["one"]) for run in runs)
    assert [len(tokens) for tokens in runs[0]["many"]] == list(MAX_TOKENS)
    eager = [r[dtype]["eager"] for r in ranks]
    assert all(run["keys"] == () and run["graph_steps"] == 0 for run in eager)
    assert all(run["steps"] == eager[0]["steps"] for run in eager)


def test_fp32_greedy_tokens_with_graphs_equal_those_without(ranks):
    for rank, result in enumerate(ranks):
        graphs, eager = result["fp32"]["graphs"], result["fp32"]["eager"]
        assert graphs["many"] == eager["many"], f"rank {rank}"
        assert graphs["one"] == eager["one"], f"rank {rank}"
