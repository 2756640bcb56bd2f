"""The symmetric-memory collectives on two GPUs of one host: NCCL's bits, results the next calls leave
alone, graph replays = eager calls.

Two NCCL ranks started by the library's launcher ask for symmetric memory (`join` leaves it off) and run
`symmetric_jobs.symmetric_rank`: rank-seeded tensors summed, gathered and reduce-scattered through the
group's ops and through NCCL alone: the all-reduce at the one-shot kernel's sizes, the two-shot
kernel's, the buffer's last fitting size and what falls back to NCCL; gathers of a data-parallel
step's rows, of odd sizes, along the vocabulary, of int64 ids and past the buffer; reduce-scatters in
bf16 and float32, along dims 0 and 1 and past the buffer; then a captured graph of dependent calls of
all three on new inputs.
"""

from __future__ import annotations

import pytest
import torch

from support.parallel_gpu_runs import nccl_group_results
from support.parallel_runs import WORLD
from support.symmetric_jobs import CASES, GATHER_CASES, SCATTER_CASES, symmetric_rank

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("symmetric-ranks")
    return nccl_group_results(symmetric_rank, str(out), out, timeout_s=120.0)


def test_join_leaves_nccl_and_asking_gives_symmetric_memorys_ops(ranks):
    for rank, result in enumerate(ranks):
        assert result["symmetric_memory"] is False, f"rank {rank}: join turned symmetric memory on"
        assert all(result["is_symmetric"]), f"rank {rank}: the asked-for ops are {result['kinds']}"


def _bits(ours: torch.Tensor, nccl: torch.Tensor, where: str) -> None:
    assert ours.shape == nccl.shape and ours.dtype == nccl.dtype, f"{where}: {ours.shape} {ours.dtype}"
    assert torch.equal(ours, nccl), f"{where}: max |ours - NCCL| {(ours.double() - nccl.double()).abs().max()}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_sums_are_nccls_bits_on_every_rank(ranks, case):
    first = ranks[0]["sums"][case][0]
    for rank, result in enumerate(ranks):
        ours, nccl = result["sums"][case]
        _bits(ours, nccl, f"rank {rank} {case}")
        assert torch.equal(ours, first), f"rank {rank} {case}: not rank 0's bits"


@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-dim{c[3]}")
def test_gathers_are_nccls_on_every_rank(ranks, case):
    for rank, result in enumerate(ranks):
        _bits(*result["gathers"][case], f"rank {rank} {case}")


@pytest.mark.parametrize("case", SCATTER_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-dim{c[3]}")
def test_reduce_scatters_are_nccls_bits(ranks, case):
    for rank, result in enumerate(ranks):
        _bits(*result["scatters"][case], f"rank {rank} {case}")


def test_results_outlive_the_next_calls(ranks):
    assert all(r["kept"] for r in ranks), [r["kept"] for r in ranks]


def test_graph_replays_equal_eager_calls(ranks):
    for rank, result in enumerate(ranks):
        replayed, eager = result["graph"]
        assert not torch.equal(replayed[0], replayed[1]), f"rank {rank}: the replays did not see the new inputs"
        for got, want in zip(replayed, eager):
            assert torch.equal(got, want), f"rank {rank}: replay differs by {(got.float() - want.float()).abs().max()}"
