"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM: one-shot prefill, chunked prefill, decode.

Prompts of 45 tokens cross the window (8), eleven CSA blocks (rate 4, index_topk 3)
and two HCA blocks (rate 16). Expected logits are transformers' full forward (no
cache) over the same tokens.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf

from support.v4_reference import Seq, new_state, reference_logits, relative_error, save_reference

PROMPT_LEN = 45


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4")
    reference = save_reference(folder, seed=3)
    return mf.load_model(folder, device="cpu"), reference


@pytest.fixture(scope="module")
def v4_double(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4-f64")
    reference = save_reference(folder, dtype=torch.float64, seed=4)
    return mf.load_model(folder, device="cpu", dtype=torch.float64), reference


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(model, state, seq: Seq, tokens: list[int], chunk: int):
    """Every position's logits, prefilling `chunk` tokens a step."""
    rows = []
    for start in range(0, len(tokens), chunk):
        plan = mf.StepPlan(prefill=(seq.plan(tokens[start:start + chunk], start),))
        batch, mode = mf.plan_step(model.config, state, plan)
        logits, state = mf.forward(model.params, state, batch, mode)
        rows.append(logits)
    return torch.cat(rows), state


def test_one_shot_prefill_matches_transformers(v4):
    model, reference = v4
    tokens = _prompt(0)
    state = new_state(model)
    got, _ = _prefill(model, state, Seq(0, state.groups), tokens, len(tokens))
    want = reference_logits(reference, tokens)
    assert got.shape == want.shape
    assert relative_error(got, want) <= 1e-4


def test_one_shot_prefill_matches_transformers_in_float64(v4_double):
    model, reference = v4_double
    tokens = _prompt(1)
    state = new_state(model)
    got, _ = _prefill(model, state, Seq(0, state.groups), tokens, len(tokens))
    # A float64 reference still rounds its rope, indexer dots and mHC weights to float32 (we keep float64
    # where it does not): agreement is at float32's precision, and a flipped top-k choice would be far above it.
    assert relative_error(got, reference_logits(reference, tokens)) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 3, 7, 18])
def test_chunked_prefill_equals_one_shot(v4, chunk):
    """Chunks of 1, 3 and 7 tokens, and of 18, which straddles a CSA block (16..19) and an HCA block (0..15, 16..31)."""
    model, _ = v4
    tokens = _prompt(2)
    state = new_state(model)
    one_shot, _ = _prefill(model, state, Seq(0, state.groups), tokens, len(tokens))
    state = new_state(model)
    chunked, _ = _prefill(model, state, Seq(0, state.groups), tokens, chunk)
    assert relative_error(chunked, one_shot) <= 1e-5


def test_prefill_then_32_decode_steps_match_the_full_forward(v4):
    """Decode crosses CSA and HCA boundaries and slides the window; every step's logits = the full forward's row."""
    model, reference = v4
    prompt = _prompt(3, 13)
    extra = _prompt(4, 32)
    state = new_state(model)
    seq = Seq(0, state.groups)
    batch, mode = mf.plan_step(model.config, state, mf.StepPlan(prefill=(seq.plan(prompt, 0, 1),)))
    logits, state = mf.forward(model.params, state, batch, mode)
    rows = [logits]
    tokens = list(prompt)
    for token in extra[:-1]:
        plan = mf.StepPlan(decode=(seq.plan([token], len(tokens), 1),))
        batch, mode = mf.plan_step(model.config, state, plan)
        assert mode.kind is mf.SegmentKind.DECODE
        logits, state = mf.decode(model.params, state, batch, mode)
        rows.append(logits)
        tokens.append(token)
    want = reference_logits(reference, tokens)[len(prompt) - 1:]
    got = torch.cat(rows)
    assert got.shape == want.shape == (32, 97)
    assert relative_error(got, want) <= 1e-4


def test_a_model_of_sliding_window_layers_only_matches_transformers(tmp_path):
    """No compressed layer, so no cache group past 0: every row's keys are its window alone."""
    reference = save_reference(tmp_path, seed=5, num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                               mlp_layer_types=["moe", "hash_moe"])
    model = mf.load_model(tmp_path, device="cpu")
    tokens = _prompt(6, 20)
    state = new_state(model)
    assert len(state.groups) == 1
    seq = Seq(0, state.groups)
    prefill, state = _prefill(model, state, seq, tokens[:11], 11)
    rows = [prefill]
    for position in range(11, 20):
        batch, mode = mf.plan_step(model.config, state, mf.StepPlan(decode=(seq.plan(tokens[position:position + 1],
                                                                                   position, 1),)))
        logits, state = mf.forward(model.params, state, batch, mode)
        rows.append(logits)
    assert relative_error(torch.cat(rows), reference_logits(reference, tokens)) <= 1e-4


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True, scoring_func="sigmoid"),
    dict(rope_parameters=None, compress_rope_theta=5000.0, rope_theta=20000.0),  # plain rope for compressed layers
    dict(compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8}, sliding_window=5,
         index_topk=6),
], ids=["tied-sigmoid", "default-compress-rope", "rates-2-8-window-5"])
def test_config_variants_match_transformers(tmp_path, overrides):
    reference = save_reference(tmp_path, seed=9, **overrides)
    model = mf.load_model(tmp_path, device="cpu")
    tokens = _prompt(7)
    state = new_state(model)
    got, _ = _prefill(model, state, Seq(0, state.groups), tokens, len(tokens))
    assert relative_error(got, reference_logits(reference, tokens)) <= 1e-4


def test_the_triton_op_table_gives_the_same_logits(v4):
    """The ops V4 takes from the table (cache writes, projections, norms, the LSE merge) on the triton backend
    (Triton's interpreter without a GPU) = the torch reference, prefill then decode."""
    model, _ = v4
    tokens = _prompt(8, 30)
    outputs = []
    for backend in ("torch", "triton"):
        state = new_state(model)
        seq = Seq(0, state.groups)
        rows = []
        for plan in (mf.StepPlan(prefill=(seq.plan(tokens[:-1], 0, 1),)),
                     mf.StepPlan(decode=(seq.plan(tokens[-1:], len(tokens) - 1, 1),))):
            batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
            logits, state = mf.forward(model.params, state, batch, mode)
            rows.append(logits)
        outputs.append(torch.cat(rows))
    assert relative_error(outputs[1], outputs[0]) <= 1e-5
