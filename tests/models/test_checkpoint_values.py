"""Checkpoints that would load silently wrong: bad config values, weight dtypes and values, huge RoPE tables."""

from __future__ import annotations

import json
import math

import pytest
import torch

import mla_func as mf
from support.checkpoint_edits import edit_config, edit_tensors, time_limit
from mla_func.core.rope_tables import DEFAULT_MAX_POSITIONS, rope_tables
from support.mla_reference import make_reference, reference_logits, rel_err, save_reference
from support.hand_plans import logits_of


@pytest.fixture(scope="module")
def reference():
    return make_reference("v3-yarn-halfsplit", seed=13)


@pytest.fixture()
def checkpoint(reference, tmp_path):
    return save_reference(reference, tmp_path / "ckpt")


def load(path, **kwargs):
    with time_limit(20):
        return mf.load_model(path, device="cpu", **kwargs)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_hidden_layers": 3.0}, "num_hidden_layers"),
        ({"hidden_size": "32"}, "hidden_size"),
        ({"vocab_size": None}, "vocab_size"),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"first_k_dense_replace": False}, "first_k_dense_replace"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"eos_token_id": 97}, "eos_token_id"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"rope_parameters": [1, 2]}, "rope_parameters"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_parameters.rope_theta"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": -2.0,
                              "original_max_position_embeddings": 64}}, "rope_parameters.factor"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                              "original_max_position_embeddings": 64, "beta_fast": 0}}, "rope_parameters.beta_fast"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                              "original_max_position_embeddings": "64"}}, "rope_parameters.original_max_position_embeddings"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.factor"),
        # JSON integers past float's range, where a float is expected (and one derived factor).
        ({"rms_norm_eps": 10 ** 400}, "rms_norm_eps"),
        ({"routed_scaling_factor": -(10 ** 400)}, "routed_scaling_factor"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10 ** 400}}, "rope_parameters.rope_theta"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 10 ** 400,
                              "original_max_position_embeddings": 64}}, "rope_parameters.factor"),
        ({"max_position_embeddings": 10 ** 400, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                                                    "original_max_position_embeddings": 64}},
         "rope_parameters.factor|max_position_embeddings"),
        ({"quantization_config": [1]}, "quantization_config"),
    ],
)
def test_bad_config_values_are_refused_naming_file_and_field(checkpoint, changes, field):
    edit_config(checkpoint, **changes)
    with pytest.raises(mf.ConfigError, match=rf"ckpt/config.json: config field '{field}'"):
        load(checkpoint)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2, 3]", "must hold a JSON object, got list"),
        ("\xff\xfe", "not valid JSON|not UTF-8"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply|not valid JSON"),
        ('{"model_type": "deepseek_v3", "vocab_size": 9' + "9" * 5000 + "}", "not valid JSON"),
    ],
)
def test_malformed_config_json_names_the_file(checkpoint, text, message):
    (checkpoint / "config.json").write_text(text, encoding="latin-1")
    with pytest.raises(mf.ConfigError, match=rf"ckpt/config.json: .*({message})"):
        load(checkpoint)


def test_a_missing_required_field_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["kv_lora_rank"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(mf.ConfigError, match=r"config.json: config field 'kv_lora_rank' = None: missing"):
        load(checkpoint)


def test_a_config_claiming_a_billion_layers_fails_fast(checkpoint):
    edit_config(checkpoint, num_hidden_layers=10**9)
    with pytest.raises(mf.CheckpointError, match=r"describes \d+ tensors, the safetensors files hold \d+"):
        load(checkpoint)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(checkpoint, value):
    def edit(t):
        t["model.layers.1.mlp.experts.5.down_proj.weight"][3, 2] = value

    edit_tensors(checkpoint, edit)
    with pytest.raises(mf.CheckpointError, match=r"tensor 'model.layers.1.mlp.experts.5.down_proj.weight' holds NaN or inf"):
        load(checkpoint)


def test_weights_that_overflow_the_model_dtype_are_refused(checkpoint):
    edit_tensors(checkpoint, lambda t: t["model.layers.0.self_attn.o_proj.weight"].__setitem__((0, 0), 1e6))
    with pytest.raises(mf.CheckpointError, match=r"'model.layers.0.self_attn.o_proj.weight' holds NaN or inf .*float16"):
        load(checkpoint, dtype=torch.float16)


@pytest.mark.parametrize(
    "dtype, shown",
    [(torch.int8, "I8"), (torch.bool, "BOOL"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.float64, "F64"),
     (torch.int64, "I64")],
)
def test_weight_dtypes_that_would_be_cast_silently_are_refused(checkpoint, dtype, shown):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    edit_tensors(checkpoint, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(mf.CheckpointError, match=rf"model.safetensors: tensor '{name}' has dtype '{shown}'"):
        load(checkpoint)


def test_float64_weights_load_into_a_float64_model(reference, checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({k: v.double() for k, v in t.items()}))
    model = load(checkpoint, dtype=torch.float64)
    tokens = [9, 8, 7, 6]
    assert model.dtype == torch.float64
    assert rel_err(logits_of(model, tokens), reference_logits(reference, tokens)) <= 1e-5


def test_half_precision_weights_load(reference, checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    tokens = [5, 4, 3]
    assert rel_err(logits_of(load(checkpoint), tokens), reference_logits(reference.to(torch.bfloat16).float(), tokens)) <= 1e-4


def test_a_huge_max_position_embeddings_builds_bounded_rope_tables(reference, checkpoint):
    edit_config(checkpoint, max_position_embeddings=10**12)
    model = load(checkpoint)
    half = model.config.qk_rope_head_dim // 2
    assert model.config.max_position_embeddings == 10**12
    assert model.max_positions == DEFAULT_MAX_POSITIONS
    assert model.params.rope_cos.shape == model.params.rope_sin.shape == (DEFAULT_MAX_POSITIONS, half)
    # The tables are the model's own: the same rows as a full-length build gives.
    cos, sin = rope_tables(model.config, "cpu", 300)
    assert torch.equal(model.params.rope_cos[:300], cos) and torch.equal(model.params.rope_sin[:300], sin)
    tokens = [1, 2, 3, 4]
    assert rel_err(logits_of(model, tokens), reference_logits(reference, tokens)) <= 1e-4


def test_max_model_len_sizes_the_tables_and_an_engine_extends_them(checkpoint):
    edit_config(checkpoint, max_position_embeddings=10**12)
    model = load(checkpoint, max_model_len=64)
    assert model.params.rope_cos.shape[0] == 64
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        load(checkpoint, max_model_len=10**12 + 1)
    engine = mf.Engine(model, max_model_len=300, num_blocks=32, block_size=4)
    assert engine.model.max_positions == 300 and model.max_positions == 64
    short = mf.Engine(model, num_blocks=32, block_size=4)
    assert short.config.max_model_len == 64
    prompt = list(range(1, 80))
    refused = short.generate([prompt], mf.SamplingParams(max_tokens=2))[0]
    assert refused.finish_reason == "error" and "maximum length is 64" in str(refused.error)
    out = engine.generate([prompt], mf.SamplingParams(max_tokens=2))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_a_step_past_the_tables_is_refused_on_the_host(checkpoint):
    edit_config(checkpoint, max_position_embeddings=10**12)
    model = load(checkpoint, max_model_len=16)
    step = mf.make_step(model)
    state = mf.init_state(model.config, num_blocks=16, block_size=4, dtype=model.dtype)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(range(1, 21)), 0, tuple(range(1, 6))),))
    with pytest.raises(mf.BatchError, match="positions reach 19"):
        step.prepare(state, plan)
    assert math.isfinite(float(model.params.rope_cos.sum()))


def test_model_config_from_file_names_the_file_and_field(checkpoint):
    edit_config(checkpoint, rope_theta=float("nan"), rope_parameters=None)
    with pytest.raises(mf.ConfigError, match=r"ckpt/config.json: config field 'rope_parameters.rope_theta' = nan"):
        mf.read_config(checkpoint / "config.json")


@pytest.mark.parametrize(
    "extra, field",
    [({"mscale": 1e308, "mscale_all_dim": 1.0}, "rope_parameters"),
     ({"mscale": 1.0, "mscale_all_dim": -10 / math.log(4.0)}, "rope_parameters"),
     ({"factor": 1e-300}, "rope_parameters.factor"),
     ({"mscale_all_dim": 1e200}, "rope_parameters.mscale_all_dim")],
)
def test_yarn_fields_that_combine_into_a_non_finite_scale_are_refused(checkpoint, extra, field):
    yarn = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64) | extra
    edit_config(checkpoint, rope_parameters=yarn)
    with pytest.raises(mf.ConfigError, match=rf"config field '{field}'"):
        load(checkpoint)
