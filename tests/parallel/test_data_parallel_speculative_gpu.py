"""Speculative decoding under data-parallel attention on two GPUs: every rank's greedy tokens equal one GPU's.

Two NCCL ranks started by the library's launcher run `dp_speculative.drafting_run` (the gloo test's runs:
K drafts a step, the ranks' loads uneven, one rank idle beside the other's draft chain, then one prompt
alone) on tiny V3 and V4 checkpoints with echoing MTP layers, in float32 on CUDA with the Triton backend and
the engine's CUDA graphs (the target's and the drafter's decode steps replay graphs under DP attention, the
ranks agreeing on every key).
One process on one GPU runs the same with and without drafts.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.dp_speculative import ALONE, K, MAX_TOKENS, RUNS, VOCAB, dp_speculative_rank, drafting_run, own_counts
from support.mtp_checkpoints import mtp_checkpoint
from support.parallel_gpu_runs import nccl_group_results
from support.parallel_runs import WORLD
from support.v4_mtp import v4_mtp_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")]

# V3's head dims at the least the Triton prefill kernel takes (the gloo test's are 8).
TRITON_DIMS = dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-speculative-gpu")
    mtp_checkpoint(root / "v3", seed=31, echo=True, vocab_size=VOCAB, **TRITON_DIMS)
    v4_mtp_checkpoint(root / "v4", seed=32, vocab_size=VOCAB, echo=True)
    return {name: str(root / name) for name in RUNS}


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """{run: [what each rank's engine gave]}."""
    out = tmp_path_factory.mktemp("dp-speculative-ranks")
    saved = nccl_group_results(dp_speculative_rank, (tuple(folders.values()), str(out)), out)
    return {name: [saved[r][folder] for r in range(WORLD)] for name, folder in folders.items()}


@pytest.fixture(scope="module")
def whole(folders):
    """{run: {k: `drafting_run` of one process on one GPU with k drafts}}, k in (0, K)."""
    out = {}
    for name, folder in folders.items():
        model = mf.load_model(folder, dtype=torch.float32, device="cuda", mtp=True)
        out[name] = {k: drafting_run(model, k) for k in (0, K)}
        del model
    return out


@pytest.mark.parametrize("run", RUNS)
def test_every_rank_returns_one_gpus_greedy_tokens(sharded, whole, run):
    plain, drafted = whole[run][0], whole[run][K]
    assert [len(t) for t in plain["many"]] == list(MAX_TOKENS)
    assert [len(t) for t in plain["one"]] == [MAX_TOKENS[ALONE]]
    assert (drafted["many"], drafted["one"]) == (plain["many"], plain["one"])
    for rank in range(WORLD):
        assert sharded[run][rank]["many"] == plain["many"], f"rank {rank}"
        assert sharded[run][rank]["one"] == plain["one"], f"rank {rank}"


@pytest.mark.parametrize("run", RUNS)
def test_the_ranks_agree_on_every_step_and_count_their_own_drafts(sharded, run):
    steps = sharded[run][0]["steps"]
    assert all(sharded[run][rank]["steps"] == steps for rank in range(1, WORLD))
    q_lens = [tuple(None if p is None else p.decode_q_len if p.decode else 0 for p in plans) for plans, _ in steps]
    assert any(K + 1 in q for q in q_lens)
    assert any(None in q and max(x or 0 for x in q) >= 3 for q in q_lens)     # one rank idle beside a chain
    longest = [max(0, *(p.decode_q_len - 2 for p in plans if p is not None)) for plans, _ in steps]
    assert [sharded[run][rank]["drafter_steps"] for rank in range(WORLD)] == [sum(longest) + len(steps)] * WORLD
    counts = [own_counts(sharded[run][rank]["steps"], rank) for rank in range(WORLD)]
    assert [sharded[run][rank]["counts"] for rank in range(WORLD)] == counts
    # The drafter's steps replay graphs too, at the same steps on every rank (one agreed key a step).
    replayed = [sharded[run][rank]["drafter_graph_steps"] for rank in range(WORLD)]
    assert replayed[0] > 0 and replayed == [replayed[0]] * WORLD
    drafted, accepted = (sum(c[i] for c in counts) for i in range(2))
    assert 0 < accepted < drafted
