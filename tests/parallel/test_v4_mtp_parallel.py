"""DeepSeek-V4's MTP layer under tensor and expert parallelism over gloo: two ranks draft as one process.

A tiny V4 checkpoint with an MTP layer (`support.v4_mtp`, an echoing drafter so that verify steps
accept drafts as well as reject them), of an even vocabulary so the embedding and head are split
too, in float and in DeepSeek's released layout (`support.v4_official`: FP8 linears, e_proj and
h_proj among them, FP4 routed experts, its widths whole blocks a rank). One group of two spawned
processes loads each tensor-parallel and expert-parallel and runs the drafter's prefill and decode
steps over the target's streams and the engine drafting two tokens a step
(`support.parallel_jobs.job_v4_mtp`); this process runs the same on the whole model.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.mla_reference import rel_err
from support.parallel_jobs import job_v4_mtp, runs_of_every_rank, v4_drafter_steps, v4_mtp_held, v4_speculative
from support.parallel_runs import TOL, WORLD
from support.v4_mtp import v4_mtp_checkpoint
from support.v4_official import write_v4_official

# An even vocabulary of at least 7 (`mtp_checkpoints.drafting_requests` stops some requests at token 6).
VOCAB = 8
# 64-wide heads (2 a rank: 128 rows of wq_b), output groups of 128, experts of 256: whole blocks a rank.
ALIGNED = dict(head_dim=64, index_head_dim=32, o_lora_rank=128, moe_intermediate_size=256)
# name -> (folder, expert_parallel) of every run
RUNS = {"tp": ("float", False), "ep": ("float", True), "fp4-tp": ("fp4", False), "fp4-ep": ("fp4", True)}
FOLDERS = ("float", "fp4")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4-mtp")
    v4_mtp_checkpoint(root / "float", seed=11, vocab_size=VOCAB, echo=True)
    v4_mtp_checkpoint(root / "aligned", seed=12, vocab_size=VOCAB, echo=True, **ALIGNED)
    formats = write_v4_official(root / "aligned", root / "fp4", root / "dequantized", "fp4")
    assert formats["mtp.0.e_proj.weight"] == formats["mtp.0.attn.wq_b.weight"] == "fp8"
    assert formats["mtp.0.ffn.experts.0.w1.weight"] == "fp4"
    return {name: root / name for name in FOLDERS}


@pytest.fixture(scope="module")
def whole(folders):
    out = {}
    for name in FOLDERS:
        model = mf.load_model(folders[name], dtype=torch.float32, device="cpu", mtp=True)
        out[name] = model, {**v4_drafter_steps(model), **v4_speculative(model), "mtp_held": v4_mtp_held(model)}
    return out


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """{run name: [what each rank saved]}, from one spawned group for every run."""
    runs = {name: (str(folders[folder]), expert_parallel) for name, (folder, expert_parallel) in RUNS.items()}
    return runs_of_every_rank(job_v4_mtp, runs, tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("run", sorted(RUNS))
def test_each_rank_holds_its_share_of_the_mtp_layer(sharded, whole, run):
    """Half the heads; half the routed experts whole (expert parallel) or every expert by columns; e_proj
    whole."""
    folder, expert_parallel = RUNS[run]
    model, results = whole[folder]
    full = results["mtp_held"]
    for rank in range(WORLD):
        share = sharded[run][rank]["mtp_held"]
        assert share["heads"] * WORLD == full["heads"]
        assert share["experts"] == (model.config.n_routed_experts // WORLD if expert_parallel else full["experts"])
        assert share["e_proj"] == full["e_proj"] == (model.config.hidden_size,) * 2


@pytest.mark.parametrize("run", sorted(name for name in RUNS if RUNS[name][0] == "fp4"))
def test_the_mtp_layers_pairs_are_cut_with_their_scales(sharded, whole, run):
    """Each FP8 / FP4 pair of the MTP layer is whole, or halved along one dim with its scale grid halved
    along the same dim, or (expert parallel) fewer whole experts; some are cut."""
    full = whole["fp4"][1]["mtp_held"]["pairs"]
    expert_parallel = RUNS[run][1]
    for rank in range(WORLD):
        got = sharded[run][rank]["mtp_held"]["pairs"]
        assert sorted(got) == sorted(full)
        cut = set()
        for name, ((values, scales), (want_values, want_scales)) in ((n, (got[n], full[n])) for n in full):
            if expert_parallel and name.endswith((".w13", ".w2")) and values[0] != want_values[0]:
                assert values[1:] == want_values[1:] and values[0] * WORLD == want_values[0], name
                continue
            halved = [d for d in range(len(values)) if values[d] != want_values[d]]
            assert len(halved) <= 1 and all(values[d] * WORLD == want_values[d] for d in halved), (name, values)
            assert [d for d in range(len(scales)) if scales[d] != want_scales[d]] == halved, (name, scales)
            assert all(scales[d] * WORLD == want_scales[d] for d in halved), (name, scales)
            cut |= {name} if halved else set()
        assert {"mtp.attn.q_b_proj", "mtp.attn.o_b_proj"} <= cut, f"rank {rank}: cut {sorted(cut)}"


@pytest.mark.parametrize("kind", ["draft_prefill", "draft_decode"])
@pytest.mark.parametrize("run", sorted(RUNS))
def test_drafter_logits_equal_one_process(sharded, whole, run, kind):
    want = whole[RUNS[run][0]][1][kind]
    ranks = sharded[run]
    for rank, got in enumerate(ranks):
        assert got[kind].shape == want.shape and rel_err(got[kind], want) <= TOL, f"rank {rank}"
    # The all-reduces give every rank the same bits, so drafts agree across ranks by construction.
    assert all(torch.equal(r[kind], ranks[0][kind]) for r in ranks)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_speculative_engine_equals_one_process(sharded, whole, run):
    """The same greedy tokens through the same accepted drafts, some drafts accepted and some not."""
    want = whole[RUNS[run][0]][1]
    drafted, accepted = want["accepted"]
    assert 0 < accepted < drafted
    for rank in range(WORLD):
        got = sharded[run][rank]
        assert got["speculative"] == want["speculative"], f"rank {rank}"
        assert got["accepted"] == want["accepted"], f"rank {rank}"
