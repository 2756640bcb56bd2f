"""Tensor, expert and data-parallel attention on two GPUs over NCCL: two ranks equal one process.

The CPU tests (`test_tensor_parallel.py`, `test_v4_parallel.py`) check the sharded forward over gloo
in fp32. Here the same scenarios (`support.parallel_runs`) run where users run them: two NCCL ranks,
one GPU each, started by the library's launcher, on the Triton op table, in bf16 and in fp32, on tiny
V3 (with and without a low-rank query), V3.2 and V4 checkpoints written by transformers (the V3 ones
with head dims of 16, the least the Triton prefill kernel takes), every mode of the CPU tests and TP and
DP attention with the collectives through symmetric memory ("tp-sym", "dp-sym"). One process on one GPU
runs the same.

* bf16 logits: the median over rows of a rank's error against one process's fp32 logits
  (||row - fp32 row|| / ||fp32 row||) is at most twice one process's own bf16 median error, plus
  1e-3. The ranks' partial sums meet in another order, and in bf16 (an attention output's all-reduce;
  the MoE's from 16 rows): they round differently, not more. The median, because in a tiny random model a few
  rows flip a discrete choice (an expert, an indexer's top-k entry) between any two roundings,
  which moves those rows a lot; a wrong shard or collective moves every row. (Over gloo on the
  CPU the ranks' medians come to 0.9 to 1.1 times one process's.)
* fp32: the engine's greedy tokens are one process's, and the logits agree to 1e-4 (max-wise);
* graphs: the same steps through a step that replays CUDA graphs, with the collectives captured
  inside them, and through that step eager give the same logits (fp32, 1e-5, as `graph_checks`),
  and the graphs did replay.

A run that raised on a rank fails its own tests with that rank's traceback; the others still judge.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import mla_func as mf
from mla_func.pytree import tree_map
from support.dsa_reference import make_v32
from support.mla_reference import make_reference, rel_err, save_reference
from support.parallel_gpu_runs import DTYPES, GPU_DP_MODES, GPU_MODES, GPU_TP_MODES, GRAPH_STEPS, run_gpu_group
from support.parallel_runs import STEP_KINDS, WORLD, rank_steps, run_steps, scenarios
from support.v4_reference import save_reference as save_v4

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")]

TRITON_DIMS = dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
CHECKPOINTS = {
    # An even vocabulary: the embedding and LM head are split too (97 is held whole).
    "v3-qlora": lambda path: save_reference(make_reference("v3-qlora-noaux", seed=11, vocab_size=98, **TRITON_DIMS),
                                            path),
    "v3-no-qlora": lambda path: save_reference(make_reference("v3-yarn-halfsplit", seed=12, **TRITON_DIMS), path),
    "v32": lambda path: save_reference(make_v32(seed=13), path),
    "v4": lambda path: save_v4(path, seed=31, vocab_size=98),
}
FP32_TOL = 1e-4   # max-wise; the CPU tests' fp32 bound is 1e-5: the GPU's kernels sum in other orders
GRAPH_TOL = 1e-5


def median_row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The median over rows of ||got row - want row|| / ||want row||: got, want [T, V]."""
    got, want = got.double(), want.double()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).median())


def assert_bf16_near(got: torch.Tensor, alone: torch.Tensor, fp32: torch.Tensor, where: str) -> None:
    """A rank's bf16 logits `got` [T, V] are as near one process's fp32 logits as one process's bf16
    logits `alone` are, by the module docstring's bound."""
    assert got.shape == fp32.shape, where
    mine, theirs = median_row_error(got, fp32), median_row_error(alone, fp32)
    assert mine <= 2 * theirs + 1e-3, f"{where}: median row error {mine:.2e}, one process's {theirs:.2e}"


def outcome(value: Any, where: str) -> Any:
    """`value`, unless it is the record of an error: then the test fails with its traceback."""
    if isinstance(value, BaseException):
        pytest.fail(f"{where}: one process raised {type(value).__name__}: {value}")
    if isinstance(value, dict) and "raised" in value:
        pytest.fail(f"{where} raised {value['raised']}\n{value['traceback']}")
    return value


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    folders = {}
    for name, save in CHECKPOINTS.items():
        folders[name] = tmp_path_factory.mktemp(name)
        save(folders[name])
    return folders


class Lazily:
    """Results by key, computed a group at a time on first use (the group: the key's first `width` fields),
    so that `-k` starts only the groups its tests read. A group whose computation raised is not run
    again: each of its tests fails with that traceback."""

    def __init__(self, compute: Any, width: int) -> None:
        self._compute, self._width, self._done = compute, width, {}

    def __getitem__(self, key: tuple[str, ...]) -> Any:
        group = key[:self._width]
        if group not in self._done:
            try:
                self._done[group] = self._compute(*group)
            except Exception:  # every test of the group fails with it, not only the first to ask
                self._done[group] = traceback.format_exc()
        done = self._done[group]
        if isinstance(done, str):
            pytest.fail(f"the runs of {group} failed:\n{done}")
        return done[key]


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """{(checkpoint, mode, dtype): [what each rank saw, or the error it raised]}, from one NCCL group a
    checkpoint and mode."""
    def run(checkpoint: str, mode: str) -> dict:
        runs = {(checkpoint, mode, dtype): (str(folders[checkpoint]), mode, dtype) for dtype in DTYPES}
        saved, failure = run_gpu_group(tuple(runs.values()), tmp_path_factory.mktemp(f"ranks-{checkpoint}-{mode}"))
        for rank, result in saved.items():
            assert "raised" not in result, f"rank {rank}: {result.get('traceback')}"
        assert failure is None and sorted(saved) == list(range(WORLD)), f"{failure}; ranks that saved: {sorted(saved)}"
        return {key: [saved[r][run] for r in range(WORLD)] for key, run in runs.items()}

    return Lazily(run, 2)


@pytest.fixture(scope="module")
def whole(folders):
    """{(checkpoint, dtype): one process's scenarios and each rank's data-parallel steps run alone, or the
    error that raised}."""
    def run(checkpoint: str) -> dict:
        results: dict[tuple[str, str], Any] = {}
        for dtype, torch_dtype in DTYPES.items():
            try:
                model = mf.load_model(folders[checkpoint], dtype=torch_dtype, device="cuda")
                alone = [run_steps(model, rank_steps(model, r)) for r in range(WORLD)]
                # On the host, where the ranks' saved results are read back.
                results[checkpoint, dtype] = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t,
                                                      {**scenarios(model), "alone": alone})
                del model
            except Exception as e:  # that checkpoint's tests fail with it; the others still run
                results[checkpoint, dtype] = e
            torch.cuda.empty_cache()
        return results

    return Lazily(run, 1)


def ranks_of(sharded: Lazily, key: tuple[str, str, str]) -> list[dict]:
    return [outcome(result, f"rank {rank} of {key}") for rank, result in enumerate(sharded[key])]


@pytest.mark.parametrize("kind", STEP_KINDS)
@pytest.mark.parametrize("mode", GPU_TP_MODES)
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_sharded_bf16_logits_are_as_near_fp32_as_one_process_s(sharded, whole, checkpoint, mode, kind):
    fp32 = outcome(whole[checkpoint, "fp32"], checkpoint)[kind]
    alone = outcome(whole[checkpoint, "bf16"], checkpoint)[kind]
    ranks = ranks_of(sharded, (checkpoint, mode, "bf16"))
    for rank, got in enumerate(ranks):
        assert_bf16_near(got[kind], alone, fp32, f"rank {rank}")
    # The all-reduce and the logits' all-gather give every rank the same bits: sampling agrees by construction.
    assert all(torch.equal(r[kind], ranks[0][kind]) for r in ranks)


@pytest.mark.parametrize("mode", GPU_TP_MODES)
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_sharded_fp32_greedy_tokens_and_logits_equal_one_process_s(sharded, whole, checkpoint, mode):
    want = outcome(whole[checkpoint, "fp32"], checkpoint)
    assert all(len(tokens) == 6 for tokens in want["greedy"])
    for rank, got in enumerate(ranks_of(sharded, (checkpoint, mode, "fp32"))):
        assert got["greedy"] == want["greedy"], f"rank {rank}"
        for kind in STEP_KINDS:
            assert got[kind].shape == want[kind].shape
            error = rel_err(got[kind], want[kind])
            assert error <= FP32_TOL, f"rank {rank}, {kind}: fp32 error {error:.2e}"


@pytest.mark.parametrize("mode", GPU_DP_MODES)
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_data_parallel_attention_equals_each_rank_alone(sharded, whole, checkpoint, mode):
    """Each rank runs its own requests (of other lengths than the other rank's: the exchange pads) through
    prefill, decode, mixed and verify steps: in bf16 (every step's rows together) as near its requests
    run alone in fp32 as one process's bf16 run is; in fp32, equal to that run step by step."""
    fp32_runs = outcome(whole[checkpoint, "fp32"], checkpoint)["alone"]
    bf16_runs = outcome(whole[checkpoint, "bf16"], checkpoint)["alone"]
    bf16_ranks = ranks_of(sharded, (checkpoint, mode, "bf16"))
    fp32_ranks = ranks_of(sharded, (checkpoint, mode, "fp32"))
    for rank in range(WORLD):
        fp32, alone = fp32_runs[rank], bf16_runs[rank]
        got, exact = bf16_ranks[rank]["steps"], fp32_ranks[rank]["steps"]
        assert len(got) == len(exact) == len(fp32)
        assert_bf16_near(torch.cat(got), torch.cat(alone), torch.cat(fp32), f"rank {rank}")
        for step, (e, want) in enumerate(zip(exact, fp32)):
            assert e.shape == want.shape, f"rank {rank}, step {step}: {tuple(e.shape)} != {tuple(want.shape)}"
            error = rel_err(e, want)
            assert error <= FP32_TOL, f"rank {rank}, step {step}: fp32 error {error:.2e} against its run alone"


@pytest.mark.parametrize("mode", sorted(GPU_MODES))
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_graphs_with_collectives_inside_equal_eager_steps(sharded, checkpoint, mode):
    """Prefill, decode and mixed steps, each replayed from a CUDA graph whose all-reduces (or all-gathers
    and reduce-scatters) were captured with it: the logits of the same steps run eagerly. Under
    data-parallel attention only the decode steps replay (the ranks agree on one padded key,
    `parallel.data_parallel.rank_modes`); the prefill and mixed steps run eagerly on every rank."""
    replayed = [False, True, True, False] if GPU_MODES[mode][1] else [True] * GRAPH_STEPS
    for rank, result in enumerate(ranks_of(sharded, (checkpoint, mode, "fp32"))):
        runs = result["graphs"]
        assert runs["replayed"] == replayed, f"rank {rank}"
        for step, (graph, eager) in enumerate(zip(runs["graph"], runs["eager"], strict=True)):
            torch.testing.assert_close(graph, eager, rtol=GRAPH_TOL, atol=GRAPH_TOL,
                                       msg=lambda m: f"rank {rank}, step {step}: {m}")
