"""Loading checkpoints and configs: what loads, and the clear errors for what does not."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import mla_func as mf
from mla_func.models.tensor_shapes import hf_tensor_shapes
from support.mla_reference import make_reference, reference_logits, rel_err, save_reference
from support.hand_plans import logits_of


@pytest.fixture(scope="module")
def reference():
    return make_reference("v3-qlora-noaux", seed=5)


@pytest.fixture()
def checkpoint(reference, tmp_path):
    return save_reference(reference, tmp_path / "ckpt")


def edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_extra_and_misshaped_tensors_are_listed_together(checkpoint):
    def edit(t):
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        t["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.zeros(7)

    edit_tensors(checkpoint, edit)
    with pytest.raises(mf.CheckpointError) as info:
        mf.load_model(checkpoint, device="cpu")
    message = str(info.value)
    assert "missing tensors: ['model.layers.1.mlp.experts.3.up_proj.weight']" in message
    assert "unexpected tensors: ['model.layers.0.self_attn.surprise.weight']" in message
    assert "model.norm.weight: expected (32,), got (7,)" in message


def test_pickle_checkpoints_are_refused(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, checkpoint / "pytorch_model.bin")
    with pytest.raises(mf.CheckpointError, match=r"refusing pickle checkpoint files \['pytorch_model.bin'\]"):
        mf.load_model(checkpoint, device="cpu")


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"scoring_func": "sqrtsoftplus"}, "scoring_func"),
        ({"topk_method": "random"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"model_type": "llama"}, "model_type"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(checkpoint, changes, field):
    edit_config(checkpoint, **changes)
    with pytest.raises(mf.ConfigError, match=f"config field '{field}'"):
        mf.load_model(checkpoint, device="cpu")


def test_sharded_checkpoint_loads_like_a_single_file(reference, tmp_path):
    single = save_reference(reference, tmp_path / "single")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    tokens = [4, 8, 15, 16, 23, 42]
    a = logits_of(mf.load_model(single, device="cpu"), tokens)
    b = logits_of(mf.load_model(tmp_path / "sharded", device="cpu"), tokens)
    assert torch.equal(a, b)


def test_layers_past_num_hidden_layers_are_skipped(reference, checkpoint):
    """DeepSeek-V3 ships its multi-token-prediction module as one extra layer."""
    def edit(t):
        for name in [n for n in t if n.startswith("model.layers.2.")]:
            t[name.replace("model.layers.2.", "model.layers.3.")] = t[name].clone()

    edit_tensors(checkpoint, edit)
    tokens = [1, 2, 3, 5, 8]
    assert rel_err(logits_of(mf.load_model(checkpoint, device="cpu"), tokens), reference_logits(reference, tokens)) <= 1e-4


def test_tied_embeddings(tmp_path):
    reference = make_reference("v2-greedy", seed=9, tie_word_embeddings=True)
    path = save_reference(reference, tmp_path / "tied")
    model = mf.load_model(path, device="cpu")
    assert model.params.lm_head is model.params.embed
    tokens = [3, 1, 4, 1, 5, 9]
    assert rel_err(logits_of(model, tokens), reference_logits(reference, tokens)) <= 1e-4


def test_legacy_rope_scaling_config_reads_like_rope_parameters(checkpoint, reference):
    config = json.loads((checkpoint / "config.json").read_text())
    yarn = dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
                mscale=1.0, mscale_all_dim=0.8)
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 5000.0, "rope_scaling": yarn}
    modern = config | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, **{k: v for k, v in yarn.items() if k != "type"}}}
    a, b = mf.config_from_hf_dict(legacy), mf.config_from_hf_dict(modern)
    assert a == b and a.rope.kind == "yarn" and a.rope.theta == 5000.0
    assert mf.config_from_hf_dict(a.to_hf_dict()) == a


def test_not_a_checkpoint_or_preset(tmp_path):
    with pytest.raises(mf.CheckpointError, match="neither a checkpoint folder nor a preset"):
        mf.load_model(tmp_path / "nothing-here", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(mf.CheckpointError, match="no config.json"):
        mf.load_model(tmp_path / "empty", device="cpu")


def test_presets():
    tiny = mf.load_model("tiny", device="cpu")
    assert tiny.dtype == torch.float32 and len(tiny.params.layers) == tiny.config.num_hidden_layers
    assert logits_of(tiny, [1, 2, 3]).isfinite().all()
    # DeepSeek-V2-Lite has 15.7B parameters; the preset's shapes must add up to that.
    total = sum(math.prod(s) for s in hf_tensor_shapes(mf.PRESETS["v2-lite"]()).values())
    assert 15.6e9 < total < 15.8e9
