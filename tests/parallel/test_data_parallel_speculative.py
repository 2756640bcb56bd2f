"""Speculative decoding under data-parallel attention over gloo: two ranks' greedy tokens equal one process's.

Each rank loads a tiny V3 and a tiny V4 checkpoint with an echoing MTP layer (drafts accepted as well as
rejected) with `Parallel(data_parallel_attention=True)` and `mtp=True`, and runs the same `Engine` calls
drafting K tokens a step: three repetitive prompts (rank 0 runs two, rank 1 one that ends first, so rank 1
idles while rank 0 still drafts; the ranks' verify steps check drafts of other counts near each request's
end; chunked prefills and mixed steps), then one prompt alone (rank 1 idle every step). Every rank must
return one process's greedy tokens, which are those of decoding without drafts; every rank must run the
same drafter steps (as many chain steps as the longest chain of any rank, then one catch-up); and each
rank's draft counts must be those of its own verify rows, read from the tokens every rank exchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import mla_func as mf
from mla_func.parallel import Parallel
from support.dp_speculative import ALONE, K, MAX_TOKENS, RUNS, VOCAB, drafting_run, own_counts
from support.mtp_checkpoints import mtp_checkpoint
from support.parallel_jobs import runs_of_every_rank
from support.parallel_runs import WORLD, RankTask
from support.v4_mtp import v4_mtp_checkpoint


def job_drafting(task: RankTask, parallel: Parallel) -> dict[Any, Any]:
    """task.args: (checkpoint folder,) each, loaded with data-parallel attention and its MTP layer;
    {args: `drafting_run` with K drafts}."""
    results = {}
    for args in task.args:
        model = mf.load_model(args[0], dtype=torch.float32, device="cpu", mtp=True,
                              parallel=dataclasses.replace(parallel, data_parallel_attention=True))
        results[args] = drafting_run(model, K)
    return results


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-speculative")
    mtp_checkpoint(root / "v3", seed=31, echo=True, vocab_size=VOCAB)
    v4_mtp_checkpoint(root / "v4", seed=32, vocab_size=VOCAB, echo=True)
    return {name: root / name for name in RUNS}


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """{run: [what each rank's engine gave]}, from one spawned group for every run."""
    return runs_of_every_rank(job_drafting, {name: (str(folders[name]),) for name in RUNS},
                              tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def whole(folders):
    """{run: {k: `drafting_run` of one process with k drafts}}, k in (0, K)."""
    out = {}
    for name in RUNS:
        model = mf.load_model(folders[name], dtype=torch.float32, device="cpu", mtp=True)
        out[name] = {k: drafting_run(model, k) for k in (0, K)}
    return out


@pytest.mark.parametrize("run", RUNS)
def test_every_rank_returns_one_process_greedy_tokens(sharded, whole, run):
    plain, drafted = whole[run][0], whole[run][K]
    assert [len(t) for t in plain["many"]] == list(MAX_TOKENS)
    assert [len(t) for t in plain["one"]] == [MAX_TOKENS[ALONE]]
    # One process: drafting keeps the tokens of decoding without drafts.
    assert (drafted["many"], drafted["one"]) == (plain["many"], plain["one"])
    for rank in range(WORLD):
        got = sharded[run][rank]
        assert got["many"] == plain["many"], f"rank {rank}"
        assert got["one"] == plain["one"], f"rank {rank}"


@pytest.mark.parametrize("run", RUNS)
def test_the_ranks_verify_drafts_while_one_idles_or_drafts_fewer(sharded, run):
    """The runs reach what the drafter's steps must agree on: verify steps of K + 1 tokens, a rank idle beside
    another's draft chain, two busy ranks of other chain lengths, mixed steps; every rank saw the same steps."""
    steps = sharded[run][0]["steps"]
    assert all(sharded[run][rank]["steps"] == steps for rank in range(1, WORLD))
    q_lens = [tuple(None if p is None else p.decode_q_len if p.decode else 0 for p in plans) for plans, _ in steps]
    assert any(K + 1 in q for q in q_lens)
    assert any(None in q and max(x or 0 for x in q) >= 3 for q in q_lens)                 # idle beside a chain
    assert any(None not in q and len(set(q)) > 1 and max(q) >= 3 for q in q_lens)         # chains of other lengths
    assert any(p is not None and p.prefill and p.decode for plans, _ in steps for p in plans)


@pytest.mark.parametrize("run", RUNS)
def test_every_rank_runs_the_longest_chain_and_one_catch_up_a_step(sharded, run):
    steps = sharded[run][0]["steps"]
    longest = [max(0, *(p.decode_q_len - 2 for p in plans if p is not None)) for plans, _ in steps]
    want = sum(longest) + len(steps)
    assert sum(longest) > 0
    assert [sharded[run][rank]["drafter_steps"] for rank in range(WORLD)] == [want] * WORLD


@pytest.mark.parametrize("run", RUNS)
def test_each_rank_counts_the_drafts_of_its_own_rows(sharded, whole, run):
    counts = [own_counts(sharded[run][rank]["steps"], rank) for rank in range(WORLD)]
    assert [sharded[run][rank]["counts"] for rank in range(WORLD)] == counts
    assert all(drafted > 0 for drafted, _ in counts)
    drafted, accepted = (sum(c[i] for c in counts) for i in range(2))
    assert 0 < accepted < drafted
    # One process's counts follow the same rule over its one rank's rows.
    assert whole[run][K]["counts"] == own_counts(whole[run][K]["steps"], 0)
