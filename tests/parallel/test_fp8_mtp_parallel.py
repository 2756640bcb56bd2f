"""Block-scaled checkpoints and the MTP layer under tensor and expert parallelism over gloo: two ranks
equal one process.

The checkpoints are written in the released layouts by independent code (`support.fp8_official`,
`support.v4_official`): a tiny DeepSeek-V3 with an MTP layer in FP8 (128 x 128 blocks, its MTP
layer's projections FP8 too), and a tiny DeepSeek-V4 with FP8 linears and FP4 routed experts, their
widths chosen so each rank's share of every cut weight is whole blocks (8 heads of 32 + 32 query
and 32 value dims, 4 a rank: 128 rows or columns; expert widths of 256). One group of two spawned
processes loads each tensor-parallel and expert-parallel and runs every step kind, the MTP drafter
and the speculative engine; this process runs the same on the whole model. A third checkpoint,
whose experts are 192 wide (96 a rank: inside a block), must be refused by name where experts are
cut by columns (tensor parallel); expert parallelism holds every expert whole, so it loads there
and equals one process.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import mla_func as mf
from mla_func.checkpoint.files import CheckpointError
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.quant_layouts import layout_of
from mla_func.parallel.config import Sharding
from mla_func.parallel.shard import Shard, check_block_aligned, cut_weight
from support.fp8_official import write_fp8_checkpoint
from support.mla_reference import rel_err
from support.mtp_checkpoints import mtp_checkpoint
from support.parallel_jobs import drafts, job_quantized, quantized_held, runs_of_every_rank
from support.parallel_runs import STEP_KINDS, TOL, WORLD, held, scenarios
from support.v4_official import write_v4_official
from support.v4_reference import save_reference as save_v4

# A V3 whose every cut is whole 128-blocks at two ranks (and not at four: the refusal below).
ALIGNED = dict(vocab_size=98, hidden_size=64, num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=32,
               qk_rope_head_dim=32, v_head_dim=32, q_lora_rank=32, kv_lora_rank=32, intermediate_size=256,
               moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
               topk_group=1, num_hidden_layers=2)
# A V4 of 64-wide heads (2 a rank: 128 rows of wq_b), output groups of 128, experts of 256.
V4_ALIGNED = dict(vocab_size=98, head_dim=64, index_head_dim=32, o_lora_rank=128, moe_intermediate_size=256)
# name -> (folder in the module's temporary root, expert_parallel, mtp) of every run
RUNS = {"v3-fp8-tp": ("v3-fp8", False, True), "v3-fp8-ep": ("v3-fp8", True, True),
        "v3-float-ep": ("v3-float", True, True), "v4-fp4-tp": ("v4-fp4", False, False),
        "v4-fp4-ep": ("v4-fp4", True, False), "misaligned-tp": ("misaligned", False, False),
        "misaligned-ep": ("misaligned", True, False)}
LOADED = sorted(name for name in RUNS if name != "misaligned-tp")
QUANTIZED = sorted(name for name in LOADED if RUNS[name][0] != "v3-float")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    # An echoing drafter guesses well on repetitive text, so verify steps accept drafts as well as reject them.
    mtp_checkpoint(root / "v3-float", seed=41, echo=True, **ALIGNED)
    write_fp8_checkpoint(root / "v3-float", root / "v3-fp8", root / "v3-dequantized")
    save_v4(root / "v4-float", seed=42, **V4_ALIGNED)
    write_v4_official(root / "v4-float", root / "v4-fp4", root / "v4-dequantized", "fp4")
    mtp_checkpoint(root / "misaligned-float", seed=43, **{**ALIGNED, "moe_intermediate_size": 192})
    write_fp8_checkpoint(root / "misaligned-float", root / "misaligned", root / "misaligned-dequantized")
    return {name: root / name for name in ("v3-fp8", "v3-float", "v4-fp4", "misaligned")}


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """{run name: [what each rank saved]}, from one spawned group for every run."""
    runs = {name: (str(folders[folder]), expert_parallel, mtp) for name, (folder, expert_parallel, mtp) in RUNS.items()}
    return runs_of_every_rank(job_quantized, runs, tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def whole(folders):
    out = {}
    for folder in ("v3-fp8", "v3-float", "v4-fp4", "misaligned"):
        mtp = folder.startswith("v3")
        model = mf.load_model(folders[folder], dtype=torch.float32, device="cpu", mtp=mtp)
        out[folder] = {**scenarios(model), **(drafts(model) if mtp else {}), "held": held(model),
                       "quantized": quantized_held(model)}
    return out


@pytest.mark.parametrize("run", QUANTIZED)
def test_each_rank_reads_its_values_and_their_blocks_scales(sharded, whole, run):
    """Every pair a rank holds is the whole one, or cut to half along one dim with its scale grid cut to half
    along the same dim, or (expert parallel) fewer whole experts."""
    folder, expert_parallel, _ = RUNS[run]
    full = whole[folder]["quantized"]
    for rank in range(WORLD):
        got = sharded[run][rank]["quantized"]
        cut = 0
        for name in sorted(set(got) & set(full)):
            (values, scales), (want_values, want_scales) = got[name], full[name]
            if expert_parallel and name.endswith((".w13", ".w2")) and values[0] != want_values[0]:
                assert values[1:] == want_values[1:] and values[0] < want_values[0], name
                continue
            halved = [d for d in range(len(values)) if values[d] != want_values[d]]
            assert len(halved) <= 1 and all(values[d] * WORLD == want_values[d] for d in halved), (name, values)
            assert [d for d in range(len(scales)) if scales[d] != want_scales[d]] == halved, (name, scales)
            assert all(scales[d] * WORLD == want_scales[d] for d in halved), (name, scales)
            cut += bool(halved)
        assert cut >= 3, f"rank {rank}: only {cut} pairs were cut"


@pytest.mark.parametrize("kind", STEP_KINDS)
@pytest.mark.parametrize("run", LOADED)
def test_sharded_logits_equal_one_process(sharded, whole, run, kind):
    want = whole[RUNS[run][0]][kind]
    ranks = sharded[run]
    for rank, got in enumerate(ranks):
        assert got[kind].shape == want.shape and rel_err(got[kind], want) <= TOL, f"rank {rank}"
    assert all(torch.equal(r[kind], ranks[0][kind]) for r in ranks)


@pytest.mark.parametrize("run", LOADED)
def test_engine_greedy_tokens_equal_one_process(sharded, whole, run):
    want = whole[RUNS[run][0]]["greedy"]
    for rank in range(WORLD):
        assert sharded[run][rank]["greedy"] == want, f"rank {rank}"


@pytest.mark.parametrize("run", sorted(name for name in LOADED if RUNS[name][2]))
def test_mtp_drafter_and_speculative_engine_equal_one_process(sharded, whole, run):
    """The sharded MTP layer drafts the logits one process drafts, and the speculative engine accepts the
    same drafts and gives the same greedy tokens."""
    want = whole[RUNS[run][0]]
    drafted, accepted = want["accepted"]
    assert 0 < accepted < drafted  # verify steps both accepted and rejected drafts
    for rank in range(WORLD):
        got = sharded[run][rank]
        assert got["drafter"].shape == want["drafter"].shape and rel_err(got["drafter"], want["drafter"]) <= TOL
        assert got["speculative"] == want["speculative"], f"rank {rank}"
        assert got["accepted"] == want["accepted"], f"rank {rank}"


def test_a_split_inside_a_block_is_refused_by_name(sharded):
    for rank in range(WORLD):
        refused = sharded["misaligned-tp"][rank].get("refused")
        assert refused is not None, f"rank {rank} loaded it"
        # Read from the file: refused before a byte of it is read.
        assert refused.startswith("CheckpointError")
        assert "'model.layers.1.mlp.experts.0.down_proj.weight' of shape [64, 192]" in refused, refused
        assert "192 columns split across 2 ranks are 96 a rank" in refused and "128-column blocks" in refused


def test_the_check_names_the_first_weight_cut_inside_a_block(folders):
    """Four ranks would cut the aligned checkpoint's 256-wide MLPs into 64 columns, inside a block."""
    path = folders["v3-fp8"]
    raw = json.loads((path / "config.json").read_text())
    config = mf.read_config(path / "config.json")
    layout = layout_of(config, raw, "config.json")
    split = config.family.tensor_split
    assert layout is not None and split is not None
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    check_block_aligned(split(config, Sharding(2)), layout, shapes, 2, str(path))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' of shape \[64, 256\] "
                                              r"\(fp8 in 128 x 128 blocks\): its 256 columns split across 4 ranks "
                                              r"are 64 a rank, not a multiple of the scales' 128-column blocks"):
        check_block_aligned(split(config, Sharding(4)), layout, shapes, 4, str(path))


def test_a_pair_cut_in_memory_keeps_its_blocks_scales():
    values = torch.randn(2, 256, 64).to(torch.float8_e4m3fn)
    w = BlockFP8Weight(values, torch.rand(2, 2, 1) + 0.5, (128, 128))
    for index in range(2):
        part = cut_weight(w, Shard(dim=-2, index=index, count=2), "w")
        assert isinstance(part, BlockFP8Weight) and part.block == (128, 128)
        rows = slice(index * 128, (index + 1) * 128)
        assert torch.equal(part.dequantize(torch.float32), w.dequantize(torch.float32)[:, rows])
    with pytest.raises(ValueError, match=r"shared w of shape \[2, 256, 64\] \(FP8 in 128 x 128 blocks\): its 256 rows "
                                         r"split across 4 ranks are 64 a rank"):
        cut_weight(w, Shard(dim=-2, index=0, count=4), "shared w")
