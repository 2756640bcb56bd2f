"""The symmetric-memory all-reduce on two GPUs of one host: NCCL's bits, a result the next call leaves
alone, graph replays = eager calls.

Two NCCL ranks started by the library's launcher ask for symmetric memory (`join` leaves it off) and run
`symmetric_jobs.symmetric_reduce_rank`: rank-seeded tensors summed through the group's all-reduce and
through NCCL alone, at the one-shot kernel's sizes, the two-shot kernel's, the buffer's last fitting
size and what falls back to NCCL; then a captured graph of two dependent sums on new inputs.
"""

from __future__ import annotations

import pytest
import torch

from support.parallel_gpu_runs import nccl_group_results
from support.parallel_runs import WORLD
from support.symmetric_jobs import CASES, symmetric_reduce_rank

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("symmetric-ranks")
    return nccl_group_results(symmetric_reduce_rank, str(out), out, timeout_s=120.0)


def test_join_leaves_nccl_and_asking_gives_the_symmetric_sum(ranks):
    for rank, result in enumerate(ranks):
        assert result["symmetric_memory"] is False, f"rank {rank}: join turned symmetric memory on"
        assert result["is_symmetric"], f"rank {rank}: the asked-for all-reduce is {result['kind']}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_sums_are_nccls_bits_on_every_rank(ranks, case):
    first = ranks[0]["cases"][case][0]
    for rank, result in enumerate(ranks):
        ours, nccl = result["cases"][case]
        assert ours.shape == nccl.shape and ours.dtype == nccl.dtype
        assert torch.equal(ours, nccl), f"rank {rank} {case}: max |ours - NCCL| {(ours.float() - nccl.float()).abs().max()}"
        assert torch.equal(ours, first), f"rank {rank} {case}: not rank 0's bits"


def test_a_result_outlives_the_next_sums(ranks):
    assert all(r["kept"] for r in ranks), [r["kept"] for r in ranks]


def test_graph_replays_equal_eager_sums(ranks):
    for rank, result in enumerate(ranks):
        replayed, eager = result["graph"]
        assert not torch.equal(replayed[0], replayed[1]), f"rank {rank}: the replays did not see the new inputs"
        for got, want in zip(replayed, eager):
            assert torch.equal(got, want), f"rank {rank}: replay differs by {(got.float() - want.float()).abs().max()}"
