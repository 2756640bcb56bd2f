"""The block-scaled FP8 checkpoint format (`mla_func.checkpoint.fp8`), its converters and `mla-func quantize`.

Round-trip bound. Each block is scaled so its largest magnitude `amax` maps to 448, e4m3's
largest value; `x = w / s` (s = amax / 448) is then rounded to e4m3. With 3 mantissa bits a
normal value (|x| >= 2^-6) rounds to within half a step, 2^-4 of its own magnitude; a
subnormal to within half the subnormal step, 2^-10. Multiplying back by s:

    |w - dequant(w)| <= 2^-4 |w| + 2^-10 s  <=  2^-4 amax  (with room to spare: 2^-10 s = amax / 458752)

so every element is within 2^-4 of its block's largest magnitude, and within 2^-4 of itself
plus a subnormal floor. The tests assert the elementwise form (a float32 rounding slack of
1e-6 relative) and the per-block one.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mla_func as mf
import mla_func.cli.commands as cli
from mla_func.checkpoint.convert import INDEX, dequantize_checkpoint, quantize_checkpoint
from mla_func.checkpoint.files import CheckpointError
from mla_func.checkpoint.fp8 import (
    FP8_DTYPE, QUANTIZATION_CONFIG, block_dequantize, block_quantize, block_size, is_quantized_name,
)
from support.hand_plans import logits_of
from support.mla_reference import make_reference, reference_logits, rel_err

QUANT = {"quantization_config": QUANTIZATION_CONFIG}
TOKENS = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [N, K]: each element's block's largest magnitude."""
    n, k = w.shape
    rows = torch.arange(n) // block[0]
    cols = torch.arange(k) // block[1]
    amax = torch.zeros(int(rows[-1]) + 1, int(cols[-1]) + 1)
    for i in range(amax.shape[0]):
        for j in range(amax.shape[1]):
            amax[i, j] = w[rows == i][:, cols == j].abs().max()
    return amax[rows][:, cols]


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((128, 256), (128, 128)),
                                          ((7, 130), (128, 128)), ((50, 70), (16, 32))])
def test_round_trip_within_the_e4m3_bound(shape, block):
    generator = torch.Generator().manual_seed(sum(shape))
    # Magnitudes over several decades, so that some blocks reach e4m3's subnormals.
    w = torch.randn(shape, generator=generator) * torch.exp(torch.randn(shape, generator=generator) * 2)
    w[: block[0], : block[1]] = 0.0  # an all-zero block
    values, scale = block_quantize(w, block)
    assert values.dtype == FP8_DTYPE and values.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (math.ceil(shape[0] / block[0]),
                                                                    math.ceil(shape[1] / block[1]))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = block_dequantize(values, scale, torch.float32, block)
    err = (back - w).abs()
    amax = _block_amax(w, block)
    full_scale = (amax / 448.0)
    assert torch.all(err <= (2.0 ** -4 * w.abs() + 2.0 ** -10 * full_scale) * (1 + 1e-6) + 1e-30)
    assert torch.all(err <= 2.0 ** -4 * amax * (1 + 1e-6))
    assert torch.equal(back[: block[0], : block[1]], torch.zeros(min(block[0], shape[0]), min(block[1], shape[1])))
    # Each block's largest magnitude lands on 448 exactly: the scale uses the whole range.
    nonzero = scale != 1.0
    assert nonzero.any()
    assert torch.isclose(values.float().abs().amax(), torch.tensor(448.0))
    print(f"{shape} in {block}: worst error / block max = {float((err / amax.clamp_min(1e-30)).max()):.4f} "
          f"(bound {2 ** -4})")


def test_is_quantized_name_follows_the_released_layout():
    quantized = [
        "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.3.mlp.experts.17.down_proj.weight", "model.layers.3.mlp.shared_experts.gate_proj.weight",
        "model.layers.3.self_attn.indexer.wq_b.weight", "model.layers.3.self_attn.indexer.wk.weight",
        "model.layers.61.mlp.experts.0.up_proj.weight",  # the MTP layer's own decoder layer
    ]
    plain = [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.3.self_attn.indexer.weights_proj.weight", "model.layers.3.self_attn.indexer.k_norm.weight",
        "model.layers.3.self_attn.indexer.k_norm.bias", "model.layers.61.eh_proj.weight",
        "model.layers.61.enorm.weight", "model.layers.61.shared_head.head.weight",
        "model.layers.0.self_attn.o_proj.weight_scale_inv",
    ]
    assert [n for n in quantized if not is_quantized_name(n, QUANT)] == []
    assert [n for n in plain if is_quantized_name(n, QUANT)] == []
    assert not any(is_quantized_name(n, {}) for n in quantized)  # no quantization_config: nothing is


@pytest.mark.parametrize("field, value", [("quant_method", "awq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                          ("weight_block_size", [128]), ("weight_block_size", [0, 128]),
                                          ("scale_fmt", "fp32"), ("group_size", 64)])
def test_a_foreign_quantization_config_is_refused_by_field(field, value):
    with pytest.raises(CheckpointError, match=rf"quantization_config\.{field}"):
        block_size({"quantization_config": {**QUANTIZATION_CONFIG, field: value}})


def test_block_size_reads_the_config():
    assert block_size({}) is None
    assert block_size(QUANT) == (128, 128)
    assert block_size({"quantization_config": {**QUANTIZATION_CONFIG, "weight_block_size": [64, 32],
                                               "scale_fmt": "ue8m0"}}) == (64, 32)
    missing = {k: v for k, v in QUANTIZATION_CONFIG.items() if k != "weight_block_size"}
    assert block_size({"quantization_config": missing}) == (128, 128)


# ---- a tiny checkpoint with partial blocks, through both converters ---------------------------------

@pytest.fixture(scope="module")
def reference():
    # hidden 200 and intermediate 160: q_a_proj [24, 200], o_proj [200, 48], gate_proj [160, 200] and
    # down_proj [200, 160] all end in partial blocks.
    return make_reference("v3-qlora-noaux", seed=5, hidden_size=200, intermediate_size=160)


@pytest.fixture(scope="module")
def folders(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    reference.save_pretrained(root / "plain")
    reference.save_pretrained(root / "sharded", max_shard_size="200KB")
    (root / "plain" / "tokenizer_config.json").write_text('{"not": "read"}')
    quantize_checkpoint(root / "plain", root / "fp8", progress=False)
    quantize_checkpoint(root / "sharded", root / "sharded-fp8", progress=False)
    return root


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("name", ["fp8", "sharded-fp8"])
def test_quantize_writes_the_released_layout(folders, name):
    source = _tensors(folders / ("plain" if name == "fp8" else "sharded"))
    out = _tensors(folders / name)
    config = json.loads((folders / name / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    quantized = sorted(n for n in source if is_quantized_name(n, config))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantized and len(quantized) > 20
    assert set(out) == set(source) | {n + "_scale_inv" for n in quantized}
    for n, tensor in source.items():
        if n in quantized:
            assert out[n].dtype == FP8_DTYPE and out[n].shape == tensor.shape, n
            scale = out[n + "_scale_inv"]
            assert scale.dtype == torch.float32
            assert tuple(scale.shape) == (math.ceil(tensor.shape[0] / 128), math.ceil(tensor.shape[1] / 128)), n
        else:
            assert out[n].dtype == tensor.dtype and torch.equal(out[n], tensor), n
    assert tuple(out["model.layers.0.self_attn.o_proj.weight_scale_inv"].shape) == (2, 1)
    assert tuple(out["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape) == (2, 2)
    if name == "sharded-fp8":
        index = json.loads((folders / name / INDEX).read_text())["weight_map"]
        assert set(index) == set(out)
        assert len(set(index.values())) > 1
        assert all(index[n + "_scale_inv"] == index[n] for n in quantized)  # a scale sits beside its weight
        for n, file in index.items():
            with safe_open(folders / name / file, framework="pt") as f:
                assert n in f.keys()
    else:
        assert (folders / name / "tokenizer_config.json").read_text() == '{"not": "read"}'
        assert not (folders / name / INDEX).exists()


@pytest.mark.parametrize("name", ["fp8", "sharded-fp8"])
def test_dequantized_checkpoint_loads_as_transformers_reads_it(folders, reference, tmp_path, name):
    dequantize_checkpoint(folders / name, tmp_path / "back", dtype=torch.float32, progress=False)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config
    assert not any(n.endswith("_scale_inv") for n in _tensors(tmp_path / "back"))
    got = logits_of(mf.load_model(tmp_path / "back", dtype=torch.float32), TOKENS)
    oracle = type(reference).from_pretrained(tmp_path / "back", dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    # Observed 1.6e-6: the converted folder is a valid checkpoint that both readers read alike.
    assert rel_err(got, reference_logits(oracle, TOKENS)) <= 1e-4
    # Against the unquantized original this MoE model is off by 0.50 of its largest logit (seed 5): a
    # weight error of a few percent flips some tokens' expert choices, a discrete change. The dense
    # model below measures the format's own error.
    assert rel_err(got, reference_logits(reference, TOKENS)) <= 1.0


def test_dequantized_dense_model_keeps_its_logits(tmp_path):
    reference = make_reference("v3-qlora-noaux", seed=6, hidden_size=200, intermediate_size=160,
                               first_k_dense_replace=3)
    reference.save_pretrained(tmp_path / "plain")
    quantize_checkpoint(tmp_path / "plain", tmp_path / "fp8", progress=False)
    dequantize_checkpoint(tmp_path / "fp8", tmp_path / "back", dtype=torch.float32, progress=False)
    want = reference_logits(reference, TOKENS)
    err = rel_err(logits_of(mf.load_model(tmp_path / "back", dtype=torch.float32), TOKENS), want)
    print(f"dense: logits max error / max logit = {err:.4f}")
    # Observed 0.081 (0.090 with seed 5): weight errors of up to 2^-4 of each block's largest
    # magnitude, through three random layers. The unquantized original reads to float32 rounding.
    assert err <= 0.25
    assert rel_err(logits_of(mf.load_model(tmp_path / "plain", dtype=torch.float32), TOKENS), want) <= 1e-4


def test_load_model_runs_the_quantized_folder_as_its_dequantized_copy(folders, tmp_path):
    """The converter's output loads as FP8 pairs and gives the logits of its dequantized copy (the
    released layout written independently, against transformers: test_fp8_load.py)."""
    dequantize_checkpoint(folders / "fp8", tmp_path / "back", dtype=torch.float32, progress=False)
    fp8 = mf.load_model(folders / "fp8", dtype=torch.float32, device="cpu")
    back = mf.load_model(tmp_path / "back", dtype=torch.float32, device="cpu")
    tokens = list(range(3, 14))
    got, want = logits_of(fp8, tokens), logits_of(back, tokens)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


# ---- malformed FP8 folders, each refused by name before anything is written ------------------------

O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def _edited(folders: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "bad"
    shutil.copytree(folders / "fp8", folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _nan_scale(tensors):
    tensors[O_PROJ + "_scale_inv"] = tensors[O_PROJ + "_scale_inv"].clone()
    tensors[O_PROJ + "_scale_inv"][1, 0] = float("nan")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(O_PROJ + "_scale_inv"), rf"quantized weight '{O_PROJ}' has no scale '{O_PROJ}_scale_inv'"),
    (lambda t: t.__setitem__("model.norm.weight_scale_inv", torch.ones(1, 1)),
     r"scale 'model.norm.weight_scale_inv' belongs to 'model.norm.weight', which the FP8 layout does not quantize"),
    (lambda t: t.pop(O_PROJ), rf"scale '{O_PROJ}_scale_inv' has no weight '{O_PROJ}'"),
    (lambda t: t.__setitem__(O_PROJ + "_scale_inv", torch.ones(1, 1)),
     rf"scale '{O_PROJ}_scale_inv' has shape \[1, 1\]; weight '{O_PROJ}' of shape \[200, 48\] in 128 x 128 blocks "
     r"needs \[2, 1\]"),
    (_nan_scale, rf"scale '{O_PROJ}_scale_inv' has 1 non-finite or non-positive values \(first nan at block \[1, 0\]\)"),
    (lambda t: t.__setitem__(O_PROJ + "_scale_inv", -t[O_PROJ + "_scale_inv"]), rf"'{O_PROJ}_scale_inv' has 2 non-finite"),
    (lambda t: t.__setitem__(O_PROJ, t[O_PROJ].float()), rf"quantized weight '{O_PROJ}' has dtype torch.float32"),
    (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(FP8_DTYPE)),
     r"tensor 'model.norm.weight' is FP8, but the layout does not quantize it"),
])
def test_malformed_fp8_is_refused_by_name(folders, tmp_path, edit, message):
    bad = _edited(folders, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        dequantize_checkpoint(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_wrong_quantization_config_field_is_refused_by_name(folders, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(folders / "fp8", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.fmt is 'e5m2'; only 'e4m3'"):
        dequantize_checkpoint(folder, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_converters_refuse_the_wrong_direction_and_a_used_destination(folders, tmp_path):
    with pytest.raises(CheckpointError, match=r"already has a quantization_config"):
        quantize_checkpoint(folders / "fp8", tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match=r"has no quantization_config; this folder is not an FP8 checkpoint"):
        dequantize_checkpoint(folders / "plain", tmp_path / "out", progress=False)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(CheckpointError, match=r"used: already exists"):
        quantize_checkpoint(folders / "plain", tmp_path / "used", progress=False)


# ---- the command line ---------------------------------------------------------------------------

def test_cli_quantize_and_dequantize(folders, tmp_path, capsys):
    assert cli.main(["quantize", str(folders / "plain"), str(tmp_path / "fp8")]) == 0
    assert cli.main(["quantize", str(tmp_path / "fp8"), str(tmp_path / "back"), "--dequantize"]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines() == [f"quantized {folders / 'plain'} -> {tmp_path / 'fp8'}",
                                f"dequantized {tmp_path / 'fp8'} -> {tmp_path / 'back'}"]
    fp8 = _tensors(tmp_path / "fp8")
    assert fp8[O_PROJ].dtype == FP8_DTYPE
    back = _tensors(tmp_path / "back")
    assert back[O_PROJ].dtype == torch.bfloat16  # --dtype's default
    assert torch.equal(back["model.norm.weight"], _tensors(folders / "plain")["model.norm.weight"])


def test_cli_errors_are_one_line(folders, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["quantize", str(folders / "plain"), str(tmp_path / "x"), "--dtype", "int8"])
    assert exited.value.code == 2
    # Python 3.12.8 and later quote the choices.
    assert re.fullmatch(r"error: --dtype: invalid choice: 'int8' \(choose from '?bfloat16'?, '?float16'?, '?float32'?\)\n",
                        capsys.readouterr().err)
    assert cli.main(["quantize", str(folders / "plain"), str(tmp_path / "x"), "--dtype", "float32"]) == 2
    assert capsys.readouterr().err == "error: --dtype applies to --dequantize only (quantizing writes float8_e4m3fn weights)\n"
    assert cli.main(["quantize", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == f"error: SRC {tmp_path / 'nothing'}: not a checkpoint folder (no config.json)\n"
    assert cli.main(["quantize", str(folders / "fp8"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "already has a quantization_config" in err
    assert not (tmp_path / "x").exists()
