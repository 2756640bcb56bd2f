"""DeepSeek-V4's MTP layer as the drafter: against its MTPBlock equations, in the engine, and as released (FP8 / FP4).

The oracle (`support.v4_mtp`) is transformers' own DeepSeek-V4 decoder layer, loaded with the MTP
layer's weights, inside the few lines of DeepSeek's MTPBlock: e_proj of the normed embedding plus
h_proj of each normed stream the target left before its hyper head, the layer, then the MTP's own
hyper head and norm and the model's head. transformers has no V4 MTP of its own (it skips `mtp.*`).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import mla_func as mf
from mla_func.kernels.fp4_weight import BlockFP4Weight
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.mtp.layer import (drafter_hidden_size, drafter_params, init_drafter_state, mtp_layer,
                                       target_step_fn)
from mla_func.models.v4.mtp import V4MTPParams
from support.mtp_checkpoints import StepRecorder, check_drafted_run, drafting_engine, drafting_requests
from support.v4_mtp import v4_mtp_checkpoint, v4_mtp_reference
from support.v4_official import write_v4_official
from support.v4_reference import Seq, new_state, relative_error

VOCAB = 97


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


def test_the_drafter_equals_the_mtp_block_equations(checkpoint):
    hf, block, tensors, model = checkpoint
    assert isinstance(model.mtp, V4MTPParams)
    tokens = [random.Random(1).randrange(2, VOCAB) for _ in range(30)]   # past the window (8), several blocks
    h, y, want = v4_mtp_reference(hf, block, tensors, tokens)
    n = len(tokens) - 1

    # The target's steps hand the drafter its streams before the hyper head, flattened [T, N * D].
    state = new_state(model)
    seq = Seq(0, state.groups)
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

    cuts = [(0, 11, "prefill"), (11, 12, "decode"), (12, 15, "decode"), (15, 17, "decode"), (17, 26, "prefill"),
            (26, 29, "decode")]
    plans = []
    for start, end, kind in cuts:
        part = seq.plan(shifted[start:end], start)
        plans.append(mf.StepPlan(prefill=(part,)) if kind == "prefill"
                     else mf.StepPlan(decode=(part,), decode_q_len=end - start))
    got, _ = _drafter_rows(model, init_drafter_state(model, state), plans, [hidden[s:e] for s, e, _ in cuts])
    assert relative_error(got, want) <= 1e-5


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


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_equal_decoding_without_drafts(echo_model, k):
    prompts, params = drafting_requests(k, SMALL_VOCAB)
    want = drafting_engine(echo_model, 0).generate(prompts, params)
    engine = drafting_engine(echo_model, k, num_blocks=NUM_BLOCKS)   # tight: preemption by recompute
    seen = StepRecorder(engine)
    got = engine.generate(prompts, params)
    check_drafted_run(engine, seen, got, want, k)
    assert any(c.finish_reason == "stop" for c in got)


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

    tokens = [random.Random(2).randrange(2, VOCAB) for _ in range(20)]
    rows = []
    for model in (official, dense):
        state = new_state(model)
        seq = Seq(0, state.groups)
        out, state = target_step_fn(model.params, state, *mf.plan_step(
            model.config, state, mf.StepPlan(prefill=(seq.plan(tokens, 0),))))
        plan = mf.StepPlan(prefill=(seq.plan(tokens[1:], 0),))
        got, _ = _drafter_rows(model, init_drafter_state(model, state), [plan], [out.hidden[: len(tokens) - 1]])
        rows.append(got)
    assert relative_error(rows[0], rows[1]) <= 1e-4
