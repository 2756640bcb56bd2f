"""DeepSeek-V4 config.json as DeepSeek ships it (`compress_ratios`, `num_hash_layers`, `rope_scaling`, ...):
read as transformers reads it, and refused by name where two spellings of one fact disagree.

RELEASED is a tiny model's config.json in DeepSeek-V4-Flash's released spelling: its fields, their
order and nesting as released, tiny values (V4-Flash ships 43 layers with 44 compress_ratios, the last for
its MTP layer; num_hash_layers 3; rope_scaling yarn factor 16 over 65536 positions; qk_rope_head_dim 64).
"""

from __future__ import annotations

import copy
import warnings

import pytest
from transformers import DeepseekV4Config

import mla_func as mf
from mla_func.models.v4.config_released import transformers_form
from support.v4_official import RELEASED_CONFIG_FIELDS, released_config

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

RELEASED = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 3,
    "hc_sinkhorn_iters": 5,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 32,
    "index_head_dim": 8,
    "index_n_heads": 16,
    "index_topk": 3,
    "initializer_range": 0.02,
    "max_position_embeddings": 256,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 5,
    "num_hash_layers": 2,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 2,
    "o_lora_rank": 8,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 4,
        "original_max_position_embeddings": 64,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 8,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 97,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0, 4, 128, 4, 0],
}

# The same model in transformers' spelling, written out by hand.
TRANSFORMERS = {
    **{name: value for name, value in RELEASED.items()
       if name not in ("compress_ratios", "num_hash_layers", "rope_scaling", "qk_rope_head_dim", "topk_method")},
    "layer_types": ["sliding_attention", "sliding_attention", CSA, HCA, CSA],
    "compress_rates": {CSA: 4, HCA: 128},
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "partial_rotary_factor": 0.5,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
                     "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                     "attention_factor": 1.0},
    },
}


def _read(raw: dict) -> mf.ModelConfig:
    """The config, with any warning about unused fields raised as an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return mf.config_from_hf_dict(raw)


def test_the_fixture_has_the_released_fields_in_their_order():
    assert tuple(RELEASED) == RELEASED_CONFIG_FIELDS


def test_the_released_spelling_reads_as_the_transformers_one():
    released, written = _read(RELEASED), _read(TRANSFORMERS)
    for name in released.__dataclass_fields__:
        assert getattr(released, name) == getattr(written, name), name
    v = released.family_fields
    assert v.layer_types == tuple(TRANSFORMERS["layer_types"]) and v.mlp_layer_types == tuple(TRANSFORMERS["mlp_layer_types"])
    assert (v.csa_rate, v.hca_rate, released.qk_rope_head_dim, v.head_dim) == (4, 128, 8, 16)
    assert (released.rope.kind, released.rope.theta) == ("default", 10000.0)
    assert (v.compress_rope.kind, v.compress_rope.theta, v.compress_rope.factor) == ("yarn", 160000.0, 4.0)
    assert (v.compress_rope.original_max_position_embeddings, v.compress_rope.attention_factor) == (64, 1.0)


def test_the_released_spelling_reads_as_transformers_reads_it():
    # What transformers' from_pretrained builds from the released config.json, saved back in its own fields.
    saved = DeepseekV4Config.from_dict(copy.deepcopy(RELEASED)).to_dict()
    assert "compress_ratios" not in saved and saved["layer_types"] == TRANSFORMERS["layer_types"]
    assert _read(RELEASED) == mf.config_from_hf_dict(saved)


def test_a_transformers_form_dict_is_left_as_it_is_and_no_input_is_changed():
    assert transformers_form(TRANSFORMERS) == TRANSFORMERS
    before = copy.deepcopy(RELEASED)
    assert "compress_ratios" not in transformers_form(RELEASED) and RELEASED == before


def test_the_checkpoint_writer_spells_the_model_as_released():
    """`support.v4_official.released_config` (what the checkpoint tests write) spells TRANSFORMERS as RELEASED."""
    assert released_config(copy.deepcopy(TRANSFORMERS)) == RELEASED


@pytest.mark.parametrize(("overrides", "names"), [
    ({"layer_types": ["sliding_attention", CSA, CSA, HCA, CSA]}, ("layer_types", "compress_ratios")),
    ({"mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"]}, ("mlp_layer_types", "num_hash_layers")),
    ({"compress_rates": {CSA: 4, HCA: 16}}, (f"compress_rates.{HCA}", "compress_ratios")),
    ({"compress_rate_csa": 8}, ("compress_rate_csa", "compress_ratios")),
    ({"mtp_compress_ratio": 4}, ("mtp_compress_ratio", "compress_ratios[5]")),
    # The MTP layer's 128 spells the HCA rate though no decoder layer is HCA.
    ({"compress_ratios": [0, 0, 4, 4, 4, 128], "compress_rates": {CSA: 4, HCA: 16}},
     (f"compress_rates.{HCA}", "compress_ratios")),
    ({"partial_rotary_factor": 0.25}, ("qk_rope_head_dim", "partial_rotary_factor")),
    ({"rope_parameters": TRANSFORMERS["rope_parameters"], "rope_scaling": {**RELEASED["rope_scaling"], "factor": 8}},
     ("rope_scaling", "rope_parameters")),
    ({"rope_scaling": {**RELEASED["rope_scaling"], "rope_theta": 10000}}, ("rope_scaling.rope_theta", "compress_rope_theta")),
])
def test_two_spellings_that_disagree_are_refused_naming_both(overrides, names):
    with pytest.raises(mf.ConfigError, match="two spellings of one fact must agree") as error:
        mf.config_from_hf_dict({**RELEASED, **overrides})
    assert all(name in str(error.value) for name in names), str(error.value)


def test_older_rate_fields_fold_into_compress_rates():
    older = {**TRANSFORMERS, "compress_rates": {CSA: 4}, "compress_rate_hca": 64}
    assert _read(older).family_fields.hca_rate == 64
    with pytest.raises(mf.ConfigError, match=f"'compress_rate_hca' = 16: but compress_rates.{HCA} = 64"):
        mf.config_from_hf_dict({**TRANSFORMERS, "compress_rates": {CSA: 4, HCA: 64}, "compress_rate_hca": 16})


def test_two_spellings_that_agree_are_read():
    both = {**RELEASED, **{name: TRANSFORMERS[name] for name in
                           ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters")}}
    assert _read(both) == _read(RELEASED)


@pytest.mark.parametrize(("ratios", "match"), [
    ([0, 0, 4, 128], r"'compress_ratios' = \[0, 0, 4, 128\]: must list at least num_hidden_layers=5"),
    ([0, 8, 4, 128, 4, 0], r"'compress_ratios'\[1\] = 8: expected one of \[0, 4, 128\]"),
    ([0, 0, 4, 128, 4, 2], r"'compress_ratios'\[5\] = 2"),
    ([0, 0, 4.0, 128, 4, 0], r"'compress_ratios'\[2\] = 4.0"),
    ({"0": 0}, r"'compress_ratios' = \{'0': 0\}: must list"),
])
def test_a_bad_compress_ratios_is_refused_by_name(ratios, match):
    with pytest.raises(mf.ConfigError, match=match):
        mf.config_from_hf_dict({**RELEASED, "compress_ratios": ratios})


@pytest.mark.parametrize(("field", "value"), [
    ("num_hash_layers", -1),
    ("num_hash_layers", "3"),
    ("rope_scaling", "yarn"),
    ("rope_scaling", {"type": "linear", "factor": 4}),
    ("qk_rope_head_dim", 8.5),
    ("qk_rope_head_dim", 16),
    ("topk_method", "group_limited_greedy"),
    ("compress_rate_csa", 0),
])
def test_a_bad_released_value_is_refused_by_name(field, value):
    with pytest.raises(mf.ConfigError, match=field):
        mf.config_from_hf_dict({**RELEASED, field: value})


def test_a_rotated_width_that_floats_cannot_carry_is_refused_by_name():
    # 58 / 112 * 112 is not 58 in floating point: transformers would rotate 57 channels.
    with pytest.raises(mf.ConfigError, match="'qk_rope_head_dim' = 58"):
        mf.config_from_hf_dict({**RELEASED, "head_dim": 112, "qk_rope_head_dim": 58})


def test_a_config_without_any_rope_spelling_is_refused_by_name():
    bare = {name: value for name, value in RELEASED.items() if name not in ("rope_scaling", "qk_rope_head_dim")}
    with pytest.raises(mf.ConfigError, match="rope_parameters"):
        mf.config_from_hf_dict(bare)


def test_entries_past_the_layers_and_hash_layers_past_them_are_read_as_transformers_reads_them():
    # A Flash variant ships 46 compress_ratios for 43 layers; a model cut to fewer layers keeps num_hash_layers.
    config = _read({**RELEASED, "compress_ratios": [0, 0, 4, 128, 4, 0, 0, 4], "num_hash_layers": 7})
    assert config.family_fields.layer_types == tuple(TRANSFORMERS["layer_types"])
    assert config.family_fields.mlp_layer_types == ("hash_moe",) * 5


def test_unknown_fields_are_still_reported():
    with pytest.warns(UserWarning, match=r"\['dspark_block_size'\]"):
        mf.config_from_hf_dict({**RELEASED, "dspark_block_size": 5})


# ---- the MTP layer's entry (compress_ratios[num_hidden_layers]) -> mtp_compress_ratio ----------------------

@pytest.mark.parametrize(("entry", "kind"), [(0, "sliding_attention"), (4, CSA), (128, HCA)])
def test_the_mtp_layers_entry_is_kept_as_its_compress_ratio(entry, kind):
    config = _read({**RELEASED, "compress_ratios": [*RELEASED["compress_ratios"][:5], entry]})
    v = config.family_fields
    assert (v.mtp_compress_ratio, v.mtp_layer_type) == (entry, kind)
    assert v.layer_types == tuple(TRANSFORMERS["layer_types"])
    assert _read({**TRANSFORMERS, "mtp_compress_ratio": entry}) == config
    assert mf.config_from_hf_dict(config.to_hf_dict()) == config


def test_a_config_without_the_mtp_layers_entry_has_a_sliding_mtp_layer():
    for raw in ({**RELEASED, "compress_ratios": RELEASED["compress_ratios"][:5]}, TRANSFORMERS):
        v = _read(raw).family_fields
        assert (v.mtp_compress_ratio, v.mtp_layer_type) == (0, "sliding_attention")


@pytest.mark.parametrize("value", [8, -1, 2, "4", 4.0, True, None, [4]])
def test_a_bad_mtp_compress_ratio_is_refused_by_name(value):
    with pytest.raises(mf.ConfigError, match=r"'mtp_compress_ratio' = .*expected one of \[0, 4, 128\]"):
        mf.config_from_hf_dict({**TRANSFORMERS, "mtp_compress_ratio": value})


def test_an_mtp_ratio_that_names_no_one_layer_type_is_refused_by_name():
    with pytest.raises(mf.ConfigError, match="'mtp_compress_ratio' = 8: names no one layer type"):
        mf.config_from_hf_dict({**TRANSFORMERS, "compress_rates": {CSA: 8, HCA: 8}, "mtp_compress_ratio": 8})
    # Its sliding default is read whatever the rates.
    v = _read({**TRANSFORMERS, "compress_rates": {CSA: 8, HCA: 8}}).family_fields
    assert v.mtp_layer_type == "sliding_attention"
