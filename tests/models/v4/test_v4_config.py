"""DeepSeek-V4 configs and checkpoints: read, written back, refused by name, and the loader's report."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import mla_func as mf
from support.checkpoint_edits import edit_config, edit_tensors
from support.v4_reference import save_reference


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-ckpt")
    save_reference(path, seed=7)
    return path


def _raw(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_config_reads_every_v4_field_and_writes_it_back(folder):
    raw = _raw(folder)
    config = mf.config_from_hf_dict(raw)
    v = config.family_fields
    assert v is not None and config.model_type == "deepseek_v4"
    assert v.layer_types == tuple(raw["layer_types"]) and v.mlp_layer_types == tuple(raw["mlp_layer_types"])
    assert (v.csa_rate, v.hca_rate, v.sliding_window, v.index_topk, v.hc_mult) == (4, 16, 8, 3, 3)
    assert config.qk_rope_head_dim == 8 and config.qk_head_dim == v.head_dim == 16
    assert config.rope.kind == "default" and v.compress_rope.kind == "yarn"
    assert v.compress_rope.attention_factor == 1.0 and v.compress_rope.theta == raw["rope_parameters"]["compress"]["rope_theta"]
    assert mf.config_from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize(("field", "value"), [
    ("scoring_func", "softmax"),
    ("num_key_value_heads", 2),
    ("compress_ratios", [0, 4, 128]),
    ("layer_types", ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    ("mlp_layer_types", ["moe"]),
    ("quantization_config", {"quant_method": "fp8"}),
    ("o_groups", 3),
    ("hidden_act", "gelu"),
    ("head_dim", None),
    ("n_shared_experts", 2),
])
def test_unsupported_fields_are_refused_by_name(folder, field, value):
    raw = {**_raw(folder), field: value}
    with pytest.raises(mf.ConfigError, match=field):
        mf.config_from_hf_dict(raw)


def test_rope_blocks_are_checked_by_name(folder):
    raw = _raw(folder)
    main = {**raw["rope_parameters"]["main"], "rope_type": "yarn", "factor": 2.0,
            "original_max_position_embeddings": 64}
    with pytest.raises(mf.ConfigError, match="rope_parameters.main.rope_type"):
        mf.config_from_hf_dict({**raw, "rope_parameters": {**raw["rope_parameters"], "main": main}})
    whole = {name: {**block, "partial_rotary_factor": 1.0} for name, block in raw["rope_parameters"].items()}
    with pytest.raises(mf.ConfigError, match="partial_rotary_factor"):
        mf.config_from_hf_dict({**raw, "rope_parameters": whole})


def test_the_mtp_layers_compress_ratio_is_read_written_back_and_given_its_cache_group(folder):
    sliding, csa, hca = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    raw = {**_raw(folder), "layer_types": [sliding, hca, sliding, hca], "mtp_compress_ratio": 4}
    config = mf.config_from_hf_dict(raw)
    assert (config.family_fields.mtp_compress_ratio, config.family_fields.mtp_layer_type) == (4, csa)
    assert mf.config_from_hf_dict(config.to_hf_dict()) == config
    # No decoder layer is CSA: the state has a group of 4-token entries for the MTP layer's alone.
    groups = mf.init_state(config, num_blocks=9, block_size=4).groups
    without = mf.init_state(mf.config_from_hf_dict({**raw, "mtp_compress_ratio": 0}), num_blocks=9,
                            block_size=4).groups
    assert [g.tokens_per_entry for g in groups] == [1, 4, 16]
    assert [g.tokens_per_entry for g in without] == [1, 16]
    # Sliding decoder layers only: the MTP layer's compress rope is a second pair of tables to hold.
    alone = {**raw, "layer_types": [sliding] * 4}
    pairs = [mf.config_from_hf_dict({**alone, "mtp_compress_ratio": ratio}) for ratio in (4, 16, 0)]
    assert [c.family.rope_table_pairs(c) for c in pairs] == [2, 2, 1]


def test_loaded_params_hold_every_tensor_in_place(folder):
    model = mf.load_model(folder, device="cpu")
    layer = model.params.layers[1]
    assert layer.attn.indexer is not None and layer.attn.compressor is not None
    assert model.params.layers[0].attn.compressor is None and model.params.layers[2].attn.indexer is None
    assert layer.mlp.tid2eid is None and model.params.layers[0].mlp.tid2eid is not None
    assert model.params.layers[-1].hc_head is not None and model.params.layers[0].hc_head is None
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    torch.testing.assert_close(layer.attn.compressor.position_bias, tensors["model.layers.1.attn.compressor.ape"])
    torch.testing.assert_close(model.params.layers[0].mlp.tid2eid, tensors["model.layers.0.ffn.gate.tid2eid"])
    w13 = torch.cat([tensors["model.layers.2.ffn.experts.3.w1.weight"], tensors["model.layers.2.ffn.experts.3.w3.weight"]])
    torch.testing.assert_close(model.params.layers[2].mlp.w13[3], w13)


def test_the_loader_reports_missing_unexpected_and_misshaped_tensors(folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)

    def edit(tensors):
        del tensors["model.layers.1.attn.indexer.wq_b.weight"]
        tensors["model.layers.0.attn.compressor.ape"] = torch.zeros(4, 32)
        tensors["model.layers.2.attn.compressor.ape"] = torch.zeros(15, 16)

    edit_tensors(broken, edit)
    with pytest.raises(mf.CheckpointError) as error:
        mf.load_model(broken, device="cpu")
    message = str(error.value)
    assert "missing tensors: ['model.layers.1.attn.indexer.wq_b.weight']" in message
    assert "unexpected tensors: ['model.layers.0.attn.compressor.ape']" in message
    assert "model.layers.2.attn.compressor.ape: expected (16, 16), got (15, 16)" in message


def test_hash_tables_must_name_experts(folder, tmp_path):
    broken = tmp_path / "bad-hash"
    shutil.copytree(folder, broken)
    edit_tensors(broken, lambda t: t.__setitem__("model.layers.0.ffn.gate.tid2eid",
                                                 torch.full((97, 2), 9, dtype=torch.int64)))
    with pytest.raises(mf.CheckpointError, match=r"tid2eid.*n_routed_experts=4"):
        mf.load_model(broken, device="cpu")
    edit_config(broken, compress_rates={"compressed_sparse_attention": 4, "sliding": 2})
    with pytest.raises(mf.ConfigError, match="compress_rates"):
        mf.load_model(broken, device="cpu")


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True},
                                       {"layer_types": ["sliding_attention"] * 4}])
def test_the_tensor_count_is_the_length_of_the_tensor_list(folder, overrides):
    from mla_func.models.tensor_shapes import hf_tensor_count, hf_tensor_shapes

    config = mf.config_from_hf_dict({**_raw(folder), **overrides})
    assert hf_tensor_count(config) == len(hf_tensor_shapes(config))


def test_deepseeks_own_tensor_names_load_the_same_params(folder, tmp_path):
    from mla_func.pytree import tree_leaves

    renamed = tmp_path / "deepseek-names"
    shutil.copytree(folder, renamed)
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}

    def rename(tensors):
        for name in list(tensors):
            new = top.get(name) or (name[len("model."):] if name.startswith("model.layers.") else name)
            tensors[new] = tensors.pop(name)
        tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)   # the multi-token-prediction layer is not run

    edit_tensors(renamed, rename)
    a, b = mf.load_model(folder, device="cpu"), mf.load_model(renamed, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a.params), tree_leaves(b.params)))
    edit_tensors(renamed, lambda t: t.__setitem__("model.norm.weight", t["norm.weight"].clone()))
    with pytest.raises(mf.CheckpointError, match="under two names"):
        mf.load_model(renamed, device="cpu")
