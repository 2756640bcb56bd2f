"""DeepSeek-V4 checkpoints load as DeepSeek ships them (FP8 linears with e8m0 `.scale`s, FP4 routed experts)
and run on the pairs, against transformers on the dequantized weights.

The official folders are written by independent code (`support.v4_official`), from fresh random tiny
V4 models whose widths cross a 128 block without filling it (hidden 160, q_lora_rank 136). The
"fp4-released" folder's config.json is also spelled as DeepSeek ships it (`compress_ratios`,
`num_hash_layers`, `rope_scaling`, ...), so its model has the rates and hash layers that spelling can say.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import mla_func as mf
from mla_func.checkpoint.files import CheckpointError
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.memory import params_bytes
from mla_func.models.quant_layouts import layout_of
from mla_func.models.tensor_shapes import hf_tensor_shapes
from mla_func.pytree import tree_leaves
from support.v4_official import write_v4_official
from support.v4_reference import Seq, new_state, relative_error, save_reference

WIDE = dict(hidden_size=160, moe_intermediate_size=96, q_lora_rank=136)
VOCAB = 97
TOL = 1e-4


# Released config.json files spell compress rates 4 and 128 only, and hash layers first (num_hash_layers).
RELEASED_SHAPES = dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                       mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])
# fixture param -> (expert_dtype, config spelling, model overrides)
CASES = {"fp4": ("fp4", "transformers", {}), "fp8": ("fp8", "transformers", {}),
         "fp4-released": ("fp4", "released", RELEASED_SHAPES)}


@pytest.fixture(scope="module", params=sorted(CASES))
def v4(request, tmp_path_factory):
    """(transformers on the dequantized weights, mla-func on the official folder, the folder, formats)."""
    expert_dtype, spelling, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(f"v4-{request.param}")
    save_reference(root / "float", seed=random.randrange(1000), **WIDE, **overrides)
    formats = write_v4_official(root / "float", root / "official", root / "dequantized", expert_dtype, spelling)
    oracle = AutoModelForCausalLM.from_pretrained(root / "dequantized", dtype=torch.float32,
                                                  attn_implementation="eager", experts_implementation="eager").eval()
    return oracle, mf.load_model(root / "official", dtype=torch.float32, device="cpu"), root / "official", formats


def _tokens(n: int) -> list[int]:
    rng = random.Random()
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def _oracle(oracle: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return oracle(torch.tensor([tokens]), use_cache=False).logits[0]


def _step(model: mf.Model, state, plan: mf.StepPlan):
    batch, mode = mf.plan_step(model.config, state, plan)
    return mf.forward(model.params, state, batch, mode)


def test_the_config_reads_as_transformers_saved_it(v4):
    _, model, folder, _ = v4
    saved = json.loads((folder.parent / "float" / "config.json").read_text())
    shipped = json.loads((folder / "config.json").read_text())
    assert ("compress_ratios" in shipped) == ("layer_types" not in shipped)
    assert mf.config_from_hf_dict(saved) == model.config


def test_weights_are_held_as_stored(v4):
    _, model, _, formats = v4
    routed = formats["model.layers.0.ffn.experts.0.w1.weight"]
    for layer in model.params.layers:
        assert isinstance(layer.mlp.w13, BlockFP4Weight if routed == "fp4" else BlockFP8Weight)
        assert isinstance(layer.attn.q_b_proj, BlockFP8Weight) and isinstance(layer.attn.o_b_proj, BlockFP8Weight)
        if routed == "fp4":  # FP8 shared experts cannot stack with FP4 routed ones: held apart
            assert isinstance(layer.mlp.shared_w13, BlockFP8Weight) and layer.mlp.w13.shape[0] == 4
        else:
            assert layer.mlp.shared_w13 is None and layer.mlp.w13.shape[0] == 5
    # A sliding layer's input rows are all FP8; a compressed layer's join BF16 compressor rows (dequantized).
    assert isinstance(model.params.layers[0].attn.in_proj, BlockFP8Weight)
    assert isinstance(model.params.layers[1].attn.in_proj, torch.Tensor)
    packed = [leaf for leaf in tree_leaves(model.params) if leaf.dtype == torch.uint8]
    assert bool(packed) == (routed == "fp4")


def test_prefill_chunked_decode_and_mixed_match_transformers(v4):
    oracle, model, _, _ = v4
    a, b = _tokens(37), _tokens(29)
    want_a, want_b = _oracle(oracle, a), _oracle(oracle, b)
    state = new_state(model)
    seq_a, seq_b = Seq(0, state.groups), Seq(1, state.groups)
    one_shot, state = _step(model, state, mf.StepPlan(prefill=(seq_a.plan(a, 0),)))
    assert relative_error(one_shot, want_a) <= TOL
    # b: chunked prefill of 5 + 6 tokens, then a mixed step (b's next chunk beside a's decode), then decodes.
    rows_b = []
    for start, stop in ((0, 5), (5, 11)):
        logits, state = _step(model, state, mf.StepPlan(prefill=(seq_b.plan(b[start:stop], start),)))
        rows_b.append(logits)
    state = new_state(model)
    _, state = _step(model, state, mf.StepPlan(prefill=(seq_a.plan(a[:30], 0, 1),)))
    for start, stop in ((0, 5), (5, 11)):
        logits, state = _step(model, state, mf.StepPlan(prefill=(seq_b.plan(b[start:stop], start),)))
    mixed, state = _step(model, state, mf.StepPlan(prefill=(seq_b.plan(b[11:], 11),),
                                                   decode=(seq_a.plan(a[30:31], 30, 1),)))
    rows_a = [mixed[-1:]]
    for position in range(31, len(a)):
        logits, state = _step(model, state, mf.StepPlan(decode=(seq_a.plan(a[position:position + 1], position, 1),)))
        rows_a.append(logits)
    assert relative_error(torch.cat([*rows_b, mixed[:-1]]), want_b) <= TOL
    assert relative_error(torch.cat(rows_a), want_a[30:]) <= TOL


def test_greedy_tokens_equal_transformers(v4):
    oracle, model, _, _ = v4
    tokens = _tokens(12)
    state = new_state(model)
    seq = Seq(0, state.groups)
    logits, state = _step(model, state, mf.StepPlan(prefill=(seq.plan(tokens, 0, 1),)))
    for _ in range(16):
        tokens.append(int(logits[-1].argmax()))
        logits, state = _step(model, state, mf.StepPlan(decode=(seq.plan(tokens[-1:], len(tokens) - 1, 1),)))
    want = _oracle(oracle, tokens).argmax(dim=-1)[11:-1].tolist()
    assert tokens[12:] == want


def _held_bytes(params) -> int:
    """Bytes of every distinct storage (compressed layers share the model's rope tables)."""
    storages = {leaf.untyped_storage().data_ptr(): leaf.untyped_storage().nbytes() for leaf in tree_leaves(params)}
    return sum(storages.values())


def _fp8_scale_bytes(params) -> int:
    """Bytes of the FP8 scales the params hold."""
    pairs = [w for layer in params.layers
             for w in (layer.attn.in_proj, layer.attn.q_b_proj, layer.attn.o_b_proj, layer.mlp.w13, layer.mlp.w2,
                       layer.mlp.shared_w13, layer.mlp.shared_w2) if isinstance(w, BlockFP8Weight)]
    return sum(4 * w.scale_inv.numel() for w in pairs)


def test_memory_estimate_counts_half_a_byte_an_fp4_value(v4):
    _, model, folder, formats = v4
    layout = layout_of(model.config, json.loads((folder / "config.json").read_text()), "config.json")
    estimate = params_bytes(model.config, torch.float32, max_model_len=model.params.max_positions, layout=layout)
    # Rows joined inside a 128-row block (wq_a | wkv, wq_b | indexer.wq_b) are scaled on a finer block:
    # the estimate counts the checkpoint's scales, the params hold more of them (and every other byte alike).
    stored_scales = sum(4 * math.prod(fmt.scale_shape(shape)) for name, shape in hf_tensor_shapes(model.config).items()
                        if (fmt := layout.format_of(name)) is not None and fmt.pack == 1 and not layout.held_dense(name))
    assert _held_bytes(model.params) == estimate - stored_scales + _fp8_scale_bytes(model.params)
    experts = model.params.layers[0].mlp.w13
    if isinstance(experts, BlockFP4Weight):
        values = experts.shape.numel()
        assert experts.nbytes == values // 2 + values // 32
        assert experts.packed.numel() * experts.packed.element_size() == values // 2


def _tamper(folder: Path, target: Path, edit) -> Path:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    target.mkdir()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text((folder / "config.json").read_text())
    return target


SCALE = "layers.1.ffn.experts.2.w3.scale"
LINEAR_SCALE = "layers.0.attn.wo_b.scale"


def _nan(tensors: dict, name: str) -> None:
    bits = tensors[name].view(torch.uint8).clone()
    bits.view(-1)[-1] = 255  # e8m0's NaN
    tensors[name] = bits.view(torch.float8_e8m0fnu)


MALFORMED = {
    "wrong-shape": (lambda t: t.__setitem__(SCALE, t[SCALE][:, :-1].contiguous()), SCALE),
    "nan": (lambda t: _nan(t, SCALE), SCALE),
    "nan-linear": (lambda t: _nan(t, LINEAR_SCALE), LINEAR_SCALE),
    "missing": (lambda t: t.pop(SCALE), SCALE),
    # The router is stored unquantized: a scale beside it belongs to nothing.
    "extra": (lambda t: t.__setitem__("layers.0.ffn.gate.scale", torch.ones(1, 2).to(torch.float8_e8m0fnu)),
              "layers.0.ffn.gate.scale"),
    "float32-scale": (lambda t: t.__setitem__(SCALE, t[SCALE].float()), SCALE),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_scale_is_refused_by_name(v4, tmp_path, case):
    _, _, folder, _ = v4
    edit, name = MALFORMED[case]
    bad = _tamper(folder, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=name.split(".", 1)[1].replace(".", r"\.")):
        mf.load_model(bad, dtype=torch.float32, device="cpu")


def test_packed_values_of_the_wrong_width_are_refused_by_name(v4, tmp_path):
    _, _, folder, formats = v4
    if formats["model.layers.0.ffn.experts.0.w1.weight"] != "fp4":
        pytest.skip("this checkpoint stores FP8 experts: only FP4 experts are packed two values a byte")
    name = "layers.0.ffn.experts.0.w1.weight"
    bad = _tamper(folder, tmp_path / "bad", lambda t: t.__setitem__(name, torch.cat([t[name], t[name]], dim=1)))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight"):
        mf.load_model(bad, dtype=torch.float32, device="cpu")


def test_an_unknown_expert_dtype_is_refused_by_name(v4, tmp_path):
    _, _, folder, _ = v4
    bad = _tamper(folder, tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "expert_dtype": "fp6"}))
    with pytest.raises(mf.ConfigError, match="expert_dtype"):
        mf.load_model(bad, dtype=torch.float32, device="cpu")
