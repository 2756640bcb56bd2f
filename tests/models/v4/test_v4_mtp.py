"""DeepSeek-V4's MTP layer as the drafter: against its MTPBlock equations, in the engine, and as released (FP8 / FP4).

The oracle (`support.v4_mtp`) is transformers' own DeepSeek-V4 decoder layer, loaded with the MTP
layer's weights, inside the few lines of DeepSeek's MTPBlock: e_proj of the normed embedding plus
h_proj of each normed stream the target left before its hyper head, the layer, then the MTP's own
hyper head and norm and the model's head. transformers has no V4 MTP of its own (it skips `mtp.*`).
The MTP layer is sliding as released, or compressed (CSA at ratio 4, HCA) as its compress ratio says.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

import mla_func as mf
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.mtp.layer import (drafter_hidden_size, drafter_params, init_drafter_state, mtp_layer,
                                       target_step_fn)
from mla_func.models.quant_layouts import layout_of
from mla_func.models.v4.layers import compressed_types
from mla_func.models.v4.mtp import PREFIX, V4MTPParams
from mla_func.models.v4.params_load import v4_rope_tables, v4_with_max_positions
from support.mtp_checkpoints import StepRecorder, check_drafted_run, drafting_engine, drafting_requests
from support.v4_mtp import v4_mtp_checkpoint, v4_mtp_reference
from support.v4_official import write_v4_official
from support.v4_reference import Seq, new_state, relative_error

VOCAB = 97
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Decoder layers of no CSA type: a CSA MTP layer's cache group is there for the drafter alone.
NO_CSA = dict(layer_types=[SLIDING, HCA, SLIDING, HCA])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-mtp") / "float"
    hf, block, tensors = v4_mtp_checkpoint(path, seed=5)
    return hf, block, tensors, mf.load_model(path, mtp=True, dtype=torch.float32, device="cpu")


def _drafter_rows(model, dstate, plans, hiddens):
    params, kind = drafter_params(model), mtp_layer(model.config)
    logits, hidden = [], []
    for plan, h in zip(plans, hiddens):
        batch, mode = mf.plan_step(model.config, dstate, plan)
        out, dstate = mf.forward_outputs(params, dstate, replace(batch, hidden=h), mode, layers=(kind,))
        logits.append(out.logits[: mode.num_logits])
        hidden.append(out.hidden[: mode.num_logits])
    return torch.cat(logits), torch.cat(hidden)


def _check_the_mtp_block_equations(hf, block, tensors, model, num_tokens, cuts):
    """The drafter's logits and streams against the oracle's over `num_tokens` tokens, in one prefill and
    as `cuts` (start, end, "prefill" or "decode") of the drafter's rows."""
    assert isinstance(model.mtp, V4MTPParams)
    tokens = [random.Random(1).randrange(2, VOCAB) for _ in range(num_tokens)]
    h, y, want = v4_mtp_reference(hf, block, tensors, tokens)
    n = len(tokens) - 1

    # The target's steps hand the drafter its streams before the hyper head, flattened [T, N * D].
    state = new_state(model, max_tokens=num_tokens)
    seq = Seq(0, state.groups, max_tokens=num_tokens)
    out, state = target_step_fn(model.params, state, *mf.plan_step(model.config, state,
                                                                   mf.StepPlan(prefill=(seq.plan(tokens, 0),))))
    assert drafter_hidden_size(model.config) == h[0].numel() == out.hidden.shape[1]
    assert relative_error(out.hidden, h.flatten(1)) <= 1e-5
    hidden = out.hidden[:n]

    # One prefill of every row, and the same rows as chunks, single decode rows and verify-like segments.
    shifted = tokens[1:]
    one = [mf.StepPlan(prefill=(seq.plan(shifted, 0),))]
    got, got_hidden = _drafter_rows(model, init_drafter_state(model, state), one, [hidden])
    assert got.shape == want.shape and relative_error(got, want) <= 1e-5
    assert relative_error(got_hidden, y.flatten(1)) <= 1e-5     # what a further draft continues from

    plans = []
    for start, end, kind in cuts:
        part = seq.plan(shifted[start:end], start)
        plans.append(mf.StepPlan(prefill=(part,)) if kind == "prefill"
                     else mf.StepPlan(decode=(part,), decode_q_len=end - start))
    got, _ = _drafter_rows(model, init_drafter_state(model, state), plans, [hidden[s:e] for s, e, _ in cuts])
    assert relative_error(got, want) <= 1e-5


# Past the window (8) and several CSA blocks (4): single decode rows and verify-like segments among chunks.
CUTS = [(0, 11, "prefill"), (11, 12, "decode"), (12, 15, "decode"), (15, 17, "decode"), (17, 26, "prefill"),
        (26, 29, "decode")]
# Across the first HCA entry at ratio 128 (rows 0..127), completed inside a verify-like segment.
HCA_CUTS = [(0, 60, "prefill"), (60, 61, "decode"), (61, 64, "decode"), (64, 125, "prefill"), (125, 127, "decode"),
            (127, 130, "decode"), (130, 149, "prefill")]


def test_the_drafter_equals_the_mtp_block_equations(checkpoint):
    hf, block, tensors, model = checkpoint
    assert model.config.family_fields.mtp_compress_ratio == 0 and mtp_layer(model.config).base.attention == SLIDING
    assert model.mtp.layer.attn.compressor is None
    _check_the_mtp_block_equations(hf, block, tensors, model, 30, CUTS)


@pytest.mark.parametrize(("kind", "ratio", "overrides", "num_tokens", "cuts"), [
    (CSA, 4, NO_CSA, 30, CUTS),
    # The only compressed layer: its compress rope tables are its own, not a decoder layer's.
    (CSA, 4, dict(layer_types=[SLIDING] * 4), 30, CUTS),
    (HCA, 128, dict(compress_rates={CSA: 4, HCA: 128}), 150, HCA_CUTS),
], ids=["csa-4", "csa-4-alone", "hca-128"])
def test_a_compressing_mtp_layer_equals_the_mtp_block_equations(tmp_path, kind, ratio, overrides, num_tokens, cuts):
    hf, block, tensors = v4_mtp_checkpoint(tmp_path, seed=6, mtp_layer_type=kind, **overrides)
    model = mf.load_model(tmp_path, mtp=True, dtype=torch.float32, device="cpu")
    v = model.config.family_fields
    assert (v.mtp_compress_ratio, v.mtp_layer_type, mtp_layer(model.config).base.attention) == (ratio, kind, kind)
    attn = model.mtp.layer.attn
    assert attn.compressor is not None and (attn.indexer is not None) == (kind == CSA)
    # The target's state holds the group of the MTP layer's entries, whether or not a decoder layer has its type.
    assert kind in compressed_types(v) and (kind in v.layer_types) == (kind == HCA)
    _check_the_mtp_block_equations(hf, block, tensors, model, num_tokens, cuts)
    # With the model's tables extended (as an engine extends them), the drafter rotates with the compress rope's.
    positions = model.params.rope_cos.shape[0] + 40
    extended = replace(model, params=v4_with_max_positions(model.params, positions))
    attn = drafter_params(extended).layers[0].layer.attn
    _, (cos, sin) = v4_rope_tables(model.config, "cpu", positions)
    assert torch.equal(attn.rope_cos, cos) and torch.equal(attn.rope_sin, sin)


def test_a_drafter_step_needs_the_streams(checkpoint):
    *_, model = checkpoint
    state = new_state(model)
    dstate = init_drafter_state(model, state)
    batch, mode = mf.plan_step(model.config, dstate, mf.StepPlan(prefill=(Seq(0, state.groups).plan([3, 4], 0),)))
    params, kind = drafter_params(model), mtp_layer(model.config)
    with pytest.raises(mf.BatchError, match="batch.hidden"):
        mf.forward_outputs(params, dstate, batch, mode, layers=(kind,))
    d = model.config.hidden_size
    with pytest.raises(mf.BatchError, match=f"3 streams of {d} \\(width {3 * d}, hc_mult \\* hidden_size\\), got "
                                            f"width {d}"):
        mf.forward_outputs(params, dstate, replace(batch, hidden=torch.zeros(2, d)), mode, layers=(kind,))


# ---- the engine: drafts change no greedy token --------------------------------------------------------------

SMALL_VOCAB = 8
NUM_BLOCKS = 14


@pytest.fixture(scope="module")
def echo_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-mtp-echo") / "float"
    v4_mtp_checkpoint(path, seed=11, vocab_size=SMALL_VOCAB, echo=True)
    return mf.load_model(path, mtp=True, dtype=torch.float32, device="cpu")


def _check_greedy_tokens(model, k):
    prompts, params = drafting_requests(k, SMALL_VOCAB)
    want = drafting_engine(model, 0).generate(prompts, params)
    engine = drafting_engine(model, k, num_blocks=NUM_BLOCKS)   # tight: preemption by recompute
    seen = StepRecorder(engine)
    got = engine.generate(prompts, params)
    check_drafted_run(engine, seen, got, want, k)
    assert any(c.finish_reason == "stop" for c in got)


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_equal_decoding_without_drafts(echo_model, k):
    _check_greedy_tokens(echo_model, k)


@pytest.fixture(scope="module", params=[(CSA, NO_CSA), (HCA, {})], ids=["csa", "hca"])
def compressing_echo_model(request, tmp_path_factory):
    # HCA at the test rate (16): the requests' few dozen tokens complete its entries, as they do CSA's.
    kind, overrides = request.param
    path = tmp_path_factory.mktemp("v4-mtp-echo-compressed") / "float"
    v4_mtp_checkpoint(path, seed=17, vocab_size=SMALL_VOCAB, echo=True, mtp_layer_type=kind, **overrides)
    model = mf.load_model(path, mtp=True, dtype=torch.float32, device="cpu")
    assert mtp_layer(model.config).base.attention == kind
    return model


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_with_a_compressing_drafter_equal_decoding_without_drafts(compressing_echo_model, k):
    _check_greedy_tokens(compressing_echo_model, k)


# ---- as DeepSeek ships it: FP8 e_proj / h_proj and linears, FP4 routed experts, DeepSeek's names -------------

WIDE = dict(hidden_size=160, moe_intermediate_size=96, q_lora_rank=136,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])


def test_a_released_checkpoint_drafts_on_its_pairs(tmp_path):
    v4_mtp_checkpoint(tmp_path / "float", seed=random.randrange(1000), **WIDE)
    formats = write_v4_official(tmp_path / "float", tmp_path / "official", tmp_path / "dequantized", "fp4", "released")
    assert formats["mtp.0.e_proj.weight"] == formats["mtp.0.h_proj.weight"] == "fp8"
    assert formats["mtp.0.ffn.experts.0.w1.weight"] == "fp4"
    official = mf.load_model(tmp_path / "official", mtp=True, dtype=torch.float32, device="cpu")
    dense = mf.load_model(tmp_path / "dequantized", mtp=True, dtype=torch.float32, device="cpu")
    mtp = official.mtp
    assert isinstance(mtp.e_proj, BlockFP8Weight) and isinstance(mtp.h_proj, BlockFP8Weight)
    assert isinstance(mtp.layer.attn.o_b_proj, BlockFP8Weight) and isinstance(mtp.layer.mlp.w13, BlockFP4Weight)
    assert isinstance(dense.mtp.e_proj, torch.Tensor)

    assert relative_error(_drafted_logits(official), _drafted_logits(dense)) <= 1e-4


def _drafted_logits(model):
    """The drafter's logits [19, V] over the target's prefill of 20 tokens."""
    tokens = [random.Random(2).randrange(2, VOCAB) for _ in range(20)]
    state = new_state(model)
    seq = Seq(0, state.groups)
    out, state = target_step_fn(model.params, state, *mf.plan_step(
        model.config, state, mf.StepPlan(prefill=(seq.plan(tokens, 0),))))
    plan = mf.StepPlan(prefill=(seq.plan(tokens[1:], 0),))
    got, _ = _drafter_rows(model, init_drafter_state(model, state), [plan], [out.hidden[: len(tokens) - 1]])
    return got


def test_a_quantized_compressing_mtp_layer_is_held_as_a_decoder_layer_of_its_type(tmp_path):
    v4_mtp_checkpoint(tmp_path / "float", seed=random.randrange(1000), mtp_layer_type=CSA, **WIDE)
    write_v4_official(tmp_path / "float", tmp_path / "official", tmp_path / "dequantized", "fp4")
    official = mf.load_model(tmp_path / "official", mtp=True, dtype=torch.float32, device="cpu")
    dense = mf.load_model(tmp_path / "dequantized", mtp=True, dtype=torch.float32, device="cpu")
    layout = layout_of(official.config, json.loads((tmp_path / "official" / "config.json").read_text()), "config.json")
    # wq_a and wkv are rows of one product with the compressor's unquantized ones: dequantized, as a CSA layer's.
    csa_layer = official.config.family_fields.layer_types.index(CSA)
    for name in ("attn.wq_a.weight", "attn.wkv.weight"):
        assert layout.held_dense(PREFIX + name) and layout.held_dense(f"model.layers.{csa_layer}.{name}")
    attn = official.mtp.layer.attn
    assert isinstance(attn.in_proj, torch.Tensor) and isinstance(attn.o_b_proj, BlockFP8Weight)
    assert attn.indexer is not None and isinstance(official.mtp.layer.mlp.w13, BlockFP4Weight)
    assert relative_error(_drafted_logits(official), _drafted_logits(dense)) <= 1e-4
