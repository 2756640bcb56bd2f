"""DeepSeek-V3.2's state and loading: the indexer-key cache leaf, donation, padding, config and checkpoint checks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mla_func as mf
from support.hand_plans import Seq, blocks, decode_plan, prefill_plan, run
from support.dsa_reference import V32, make_v32
from mla_func.core.prepare import state_bytes_per_block
from mla_func.models.dsa.attention import DSA_DECODER
from mla_func.models.presets import v32_lite
from mla_func.models.tensor_shapes import hf_tensor_count, hf_tensor_shapes
from support.mla_reference import rel_err

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32-state")
    make_v32("v32", dtype=torch.float64, seed=8).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return mf.load_model(folder, dtype=torch.float64, device="cpu")


def fresh_state(model):
    return mf.init_state(model, num_blocks=40, block_size=BLOCK_SIZE)


def test_each_layer_caches_latents_and_indexer_keys(model):
    state = fresh_state(model)
    c = model.config
    assert mf.layer_kinds(c) == (DSA_DECODER,) * c.num_hidden_layers
    for cache in state.layers:
        assert isinstance(cache, mf.DSALayerCache)
        assert cache.kv.shape == (40, BLOCK_SIZE, c.kv_cache_dim)
        assert cache.index_k.shape == (40, BLOCK_SIZE, c.index_head_dim)
        assert not cache.kv.any() and not cache.index_k.any()
    assert len(state.leaves()) == 2 * c.num_hidden_layers
    per_token = c.num_hidden_layers * (c.kv_cache_dim + c.index_head_dim) * 8
    assert state.bytes_per_block() == state_bytes_per_block(model, BLOCK_SIZE) == BLOCK_SIZE * per_token


def test_donation_covers_the_indexer_cache(model):
    state = fresh_state(model)
    seq = Seq(blocks(0, 6))
    plan = mf.StepPlan(prefill=(prefill_plan(seq, list(range(3, 17))),))
    batch, mode = mf.plan_step(model.config, state, plan)
    _, kept = mf.forward(model.params, state, batch, mode, copy=True)
    assert not state.is_donated
    assert not any(leaf.any() for leaf in state.leaves())                 # copy=True: nothing written
    written = kept.layers[0].index_k[1:5].flatten(0, 1)[:14]                # the sequence's 14 slots
    assert (written.abs().sum(-1) > 0).all() and not kept.layers[0].index_k[5:].any()
    _, new = mf.forward(model.params, state, batch, mode)
    assert state.is_donated
    for a, b in zip(new.leaves(), kept.leaves()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(mf.DonatedStateError):
        mf.forward(model.params, state, batch, mode)


@pytest.mark.parametrize("extra", [(3, 1, 0, 0), (0, 0, 2, 1), (5, 2, 3, 2)])
def test_padding_changes_nothing_for_real_rows(model, extra):
    """Padded rows, sequences and table columns leave real rows' logits and both caches untouched."""
    seqs = [Seq(blocks(i, 6)) for i in range(4)]
    state = fresh_state(model)
    for j in (2, 3):
        _, state = run(model, state, mf.StepPlan(prefill=(prefill_plan(seqs[j], list(range(j, j + 11 + j))),)))
        seqs[j].cached = 11 + j
    plan = mf.StepPlan(prefill=tuple(prefill_plan(seqs[i], list(range(5 * i, 5 * i + 9 + 4 * i)), all_logits=False)
                                     for i in (0, 1)),
                       decode=tuple(decode_plan(seqs[j], 40 + j) for j in (2, 3)))
    exact_batch, exact_mode = mf.plan_step(model.config, state, plan)
    exact_logits, exact_state = mf.forward(model.params, state, exact_batch, exact_mode, copy=True)
    tokens_pad, pseq_pad, dseq_pad, width_pad = extra
    mode = dataclasses.replace(
        exact_mode, padded_prefill_tokens=exact_mode.padded_prefill_tokens + tokens_pad,
        padded_prefill_seqs=exact_mode.padded_prefill_seqs + pseq_pad,
        padded_decode_seqs=exact_mode.padded_decode_seqs + dseq_pad,
        block_table_width=exact_mode.block_table_width + width_pad)
    mode = dataclasses.replace(mode, padded_num_logits=mode.padded_prefill_seqs + mode.padded_decode_seqs)
    batch = mf.build_batch(plan, mode, block_size=BLOCK_SIZE, device="cpu")
    assert int((batch.slot_mapping < 0).sum()) == mode.num_tokens - exact_mode.num_tokens
    logits, padded_state = mf.forward(model.params, state, batch, mode, copy=True)
    assert rel_err(logits[:exact_mode.num_logits], exact_logits[:exact_mode.num_logits]) <= 1e-12
    for exact_cache, padded_cache in zip(exact_state.leaves(), padded_state.leaves()):
        torch.testing.assert_close(padded_cache[1:], exact_cache[1:], rtol=1e-12, atol=1e-12)


def _edit(folder, tmp_path, tensors=None, **config_changes):
    path = tmp_path / "edited"
    path.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    if tensors:
        tensors(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_indexer_tensors_are_checked_like_every_other(folder, tmp_path):
    def edit(t):
        del t["model.layers.1.self_attn.indexer.k_norm.bias"]
        t["model.layers.0.self_attn.indexer.extra.weight"] = torch.zeros(2)
        t["model.layers.0.self_attn.indexer.wq_b.weight"] = torch.zeros(3, 24)

    with pytest.raises(mf.CheckpointError) as info:
        mf.load_model(_edit(folder, tmp_path, edit), dtype=torch.float64, device="cpu")
    message = str(info.value)
    assert "missing tensors: ['model.layers.1.self_attn.indexer.k_norm.bias']" in message
    assert "unexpected tensors: ['model.layers.0.self_attn.indexer.extra.weight']" in message
    assert "model.layers.0.self_attn.indexer.wq_b.weight: expected (256, 24), got (3, 24)" in message


@pytest.mark.parametrize("changes, field", [
    (dict(index_topk=None), "index_topk"),
    (dict(index_head_dim=2), "index_head_dim"),
    (dict(index_n_heads=0), "index_n_heads"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(layer_types=["full_attention", "indexed_attention"]), "layer_types"),
    (dict(mlp_layer_types=["sparse", "sparse"]), "mlp_layer_types"),
])
def test_unsupported_v32_configs_are_refused_by_name(folder, changes, field):
    raw = {**json.loads((folder / "config.json").read_text()), **changes}
    with pytest.raises(mf.ConfigError, match=f"'{field}'"):
        mf.config_from_hf_dict(raw)


def test_v32_config_round_trips_and_v3_refuses_indexer_fields(model):
    c = model.config
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (V32["index_n_heads"], V32["index_head_dim"], 8)
    assert mf.config_from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(mf.ConfigError, match="'index_n_heads' = 16: only deepseek_v32"):
        dataclasses.replace(c, family=mf.family_for("deepseek_v3"), model_type="deepseek_v3")


def test_v32_lite_preset_has_the_issue_shapes():
    c = v32_lite()
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == ("deepseek_v32", 27, 2048, 16)
    assert (c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk) == (1536, 64, 128, 2048)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (64, 6, 2)
    assert "v32-lite" in mf.PRESETS and hf_tensor_count(c) == len(hf_tensor_shapes(c))
    assert hf_tensor_shapes(c)["model.layers.3.self_attn.indexer.wq_b.weight"] == (64 * 128, 1536)
    assert mf.config_from_hf_dict(c.to_hf_dict()) == c


def test_both_names_of_the_sparse_attention_layer_are_read(folder):
    raw = json.loads((folder / "config.json").read_text())
    for name in ("indexed_attention", "deepseek_sparse_attention"):
        config = mf.config_from_hf_dict({**raw, "layer_types": [name] * raw["num_hidden_layers"]})
        assert config.has_indexer and config.index_topk == 8


def test_indexer_rows_live_in_the_attention_matrices_and_export_back(model, folder):
    # The indexer's wq_b / wk are the last rows of q_b_proj / qkv_a_proj (one GEMM per input);
    # exporting splits them out again under their checkpoint names, equal to the file's.
    from mla_func.demo.export import params_to_hf
    from mla_func.core.params import params_from_hf
    from mla_func.pytree import tree_leaves

    c = model.config
    a, i = model.params.layers[0].attn, "model.layers.0.self_attn."
    assert a.qkv_a_proj.shape[0] == c.q_lora_rank + c.kv_cache_dim + c.index_head_dim
    assert a.q_b_proj.shape[0] == c.num_attention_heads * c.qk_head_dim + c.index_n_heads * c.index_head_dim
    saved = load_file(str(next(folder.glob("*.safetensors"))))
    tensors = params_to_hf(model.params)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == hf_tensor_shapes(c)
    for name in ("indexer.wq_b.weight", "indexer.wk.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight"):
        assert torch.equal(tensors[i + name], saved[i + name].to(torch.float64)), name
    rebuilt = params_from_hf(c, tensors.__getitem__, dtype=torch.float64, device="cpu")
    for x, y in zip(tree_leaves(model.params), tree_leaves(rebuilt), strict=True):
        assert torch.equal(x, y)
