"""The MTP layer (the drafter) against a plain-torch reference of DeepSeek-V3's MTP equations.

transformers does not run MTP layers, so the test writes them (DeepSeek-V3 report, sec. 2.2),
for the token t_{i+1} and the target's last hidden state h_i at position i:

    h'_i   = M [RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)]     (M = eh_proj; the released weights
                                                              read the embedding in the first half)
    h^1    = TRM(h'_{0..i})                                  (one causal decoder layer)
    P_{i+2} = OutHead(RMSNorm(h^1_i))

with TRM run by transformers' own DeepSeek-V3 decoder layer loaded with the MTP layer's weights.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import mla_func as mf
from mla_func.models.mtp.layer import drafter_params, init_drafter_state, mtp_layer, target_step_fn
from support.mtp_checkpoints import mtp_checkpoint
from support.mla_reference import rel_err
from support.mtp_checkpoints import mtp_reference

BLOCK = 4


def _drafter_rows(model, dstate, plans, hiddens):
    params, kind = drafter_params(model), mtp_layer(model.config)
    rows = []
    for plan, hidden in zip(plans, hiddens):
        batch, mode = mf.plan_step(model.config, dstate, plan)
        out, dstate = mf.forward_outputs(params, dstate, replace(batch, hidden=hidden), mode, layers=(kind,))
        rows.append(out.logits[: mode.num_logits])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, path = mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "v3", seed=5)
    return hf.double(), path


def test_mtp_logits_equal_the_equations(checkpoint):
    hf, path = checkpoint
    model = mf.load_model(path, mtp=True, dtype=torch.float64, device="cpu")
    tokens = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    h, want = mtp_reference(hf, load_file(path / "model.safetensors"), tokens)

    # Our target's hidden states are the ones the drafter continues from.
    state = mf.init_state(model, num_blocks=16, block_size=BLOCK)
    table = (1, 2, 3)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), 0, table, len(tokens)),))
    out, state = target_step_fn(model.params, state, *mf.plan_step(model.config, state, plan))
    assert rel_err(out.hidden, h) < 1e-5  # transformers routes in float32

    # One prefill of every row; then a prefill chunk, single decode rows and a verify-like segment.
    n = len(tokens) - 1
    shifted = tuple(tokens[1:])
    one = mf.StepPlan(prefill=(mf.SeqPlan(shifted, 0, table, n),))
    got = _drafter_rows(model, init_drafter_state(model, state), [one], [h[:n]])
    assert got.shape == want.shape and rel_err(got, want) < 1e-5

    plans = [mf.StepPlan(prefill=(mf.SeqPlan(shifted[:4], 0, table, 4),)),
             mf.StepPlan(decode=(mf.SeqPlan(shifted[4:5], 4, table),)),
             mf.StepPlan(decode=(mf.SeqPlan(shifted[5:8], 5, table, 3),), decode_q_len=3),
             mf.StepPlan(decode=(mf.SeqPlan(shifted[8:10], 8, table, 2),), decode_q_len=2)]
    hiddens = [h[:4], h[4:5], h[5:8], h[8:10]]
    got = _drafter_rows(model, init_drafter_state(model, state), plans, hiddens)
    assert rel_err(got, want) < 1e-5


def test_checkpoint_copies_of_embedding_and_head_are_shared(tmp_path):
    _, path = mtp_checkpoint(tmp_path / "v3", seed=6, with_copies=True)
    model = mf.load_model(path, mtp=True, dtype=torch.float32, device="cpu")
    assert model.mtp.embed is model.params.embed and model.mtp.head is model.params.lm_head
    assert mf.load_model(path, device="cpu").mtp is None


def test_a_checkpoint_without_an_mtp_layer_is_refused(tmp_path):
    from support.mla_reference import make_reference

    make_reference("v3-qlora-noaux", seed=7).save_pretrained(tmp_path / "plain")
    with pytest.raises(mf.CheckpointError, match=r"has no multi-token-prediction \(MTP\) layer \(no tensor named model\.layers\.3\.\*\)"):
        mf.load_model(tmp_path / "plain", mtp=True, device="cpu")


def test_a_drafter_step_needs_hidden_states():
    model = mf.load_model("tiny", mtp=True, dtype=torch.float32, device="cpu")
    state = mf.init_state(model, num_blocks=8, block_size=BLOCK)
    dstate = init_drafter_state(model, state)
    plan = mf.StepPlan(prefill=(mf.SeqPlan((1, 2), 0, (1,)),))
    batch, mode = mf.plan_step(model.config, dstate, plan)
    with pytest.raises(mf.BatchError, match="batch.hidden"):
        mf.forward_outputs(drafter_params(model), dstate, batch, mode, layers=(mtp_layer(model.config),))
    with pytest.raises(mf.BatchError, match=r"hidden: expected shape \(2, D\)"):
        mf.forward_outputs(drafter_params(model), dstate, replace(batch, hidden=torch.zeros(3, 64)), mode,
                           layers=(mtp_layer(model.config),))
