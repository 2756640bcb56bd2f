"""Sparse attention as selection: dense when the context fits in index_topk, and the tokens it selects.

* With every context no longer than index_topk, the indexer selects every key, in
  order, so DSA equals the dense V3 layer on the same weights (prefill and decode).
* `record_index_choice` reads, from the forward that made the logits, which tokens each
  query attended to: the same sets as transformers' indexer picks.
"""

from __future__ import annotations

import random

import pytest
import torch

import mla_func as mf
from support.dsa_reference import check_top_k_margins, make_v32, save_and_load
from mla_func.models.dsa.indexer import record_index_choice
from mla_func.models.mla.layer import MLA_DECODER
from support.mla_reference import rel_err

BLOCK_SIZE = 4


def tokens_of(n, seed, vocab=97):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def run_sequence(model, tokens, prompt_len, *, layers=None, ops=None):
    """Prefill `prompt_len` tokens, then decode the rest one by one; every position's logits [T, V]."""
    kinds = None if layers is None else (layers,) * model.config.num_hidden_layers
    state = mf.init_state(model, num_blocks=2 + len(tokens) // BLOCK_SIZE, block_size=BLOCK_SIZE, layers=kinds)
    table = tuple(range(1, state.num_blocks))
    steps = [mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens[:prompt_len]), 0, table, prompt_len),))]
    steps += [mf.StepPlan(decode=(mf.SeqPlan((t,), p, table, 1),)) for p, t in enumerate(tokens) if p >= prompt_len]
    rows = []
    for plan in steps:
        batch, mode = mf.plan_step(model.config, state, plan)
        logits, state = mf.forward(model.params, state, batch, mode, layers=kinds, ops=ops)
        rows.append(logits[: mode.num_logits])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def wide_topk(tmp_path_factory):
    """index_topk 48: every context of these tests (up to 40 tokens) fits."""
    return save_and_load(make_v32("v32", seed=5, index_topk=48), tmp_path_factory.mktemp("wide"), torch.float32)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    reference = make_v32("v32", seed=3)
    return reference, save_and_load(reference, tmp_path_factory.mktemp("sparse"), torch.float32)


def test_context_within_topk_equals_dense_attention(wide_topk):
    tokens = tokens_of(40, seed=1)
    dsa = run_sequence(wide_topk, tokens, prompt_len=30)
    dense = run_sequence(wide_topk, tokens, prompt_len=30, layers=MLA_DECODER)
    assert dsa.shape == dense.shape == (40, 97)
    assert rel_err(dsa, dense) <= 1e-5


def test_context_beyond_topk_is_sparse(sparse):
    """The same comparison with index_topk 8 differs once contexts pass 8 keys: selection is real."""
    _, model = sparse
    tokens = tokens_of(30, seed=2)
    dsa = run_sequence(model, tokens, prompt_len=30)
    dense = run_sequence(model, tokens, prompt_len=30, layers=MLA_DECODER)
    assert rel_err(dsa[:8], dense[:8]) <= 1e-5      # positions 0..7 see at most 8 keys
    assert rel_err(dsa[8:], dense[8:]) > 1e-2


def _transformers_choice(reference, tokens):
    """Each layer's top-k indices [S, topk] from transformers' indexer, in one causal pass."""
    seen = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda _m, _i, out: seen.append(out[0]))
             for layer in reference.model.layers]
    try:
        with torch.no_grad():
            reference(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_recorded_choice_is_transformers_choice(sparse):
    """Prefill 25 tokens then decode 10: per layer and position, the keys attended to are the oracle's."""
    reference, model = sparse
    tokens = tokens_of(35, seed=4)
    check_top_k_margins(model, tokens, BLOCK_SIZE)
    ops, chosen = record_index_choice(mf.kernels.ops_for("torch"))
    run_sequence(model, tokens, prompt_len=25, ops=ops)
    layers = model.config.num_hidden_layers
    assert len(chosen) == layers * (1 + 10)          # one entry per layer per step
    # Per layer: the prefill step's rows, then one row per decode step.
    ours = [torch.cat([chosen[layer]] + [chosen[layers * s + layer] for s in range(1, 11)]) for layer in range(layers)]
    theirs = _transformers_choice(reference, tokens)
    k = model.config.index_topk
    for layer in range(layers):
        assert ours[layer].shape == (35, k) and ours[layer].dtype == torch.int32
        for pos in range(35):
            row = ours[layer][pos].tolist()
            visible = [j for j in row if j >= 0]
            assert visible == sorted(visible) and len(visible) == min(k, pos + 1)
            assert row[len(visible):] == [-1] * (k - len(visible))
            want = {j for j in theirs[layer][pos].tolist() if j <= pos}
            assert set(visible) == want, f"layer {layer}, position {pos}"


def test_the_tie_guard_fails_loudly_on_tied_scores(tmp_path):
    """One indexer head: most scores are ReLU zeros, so the k-th score ties and the guard must fail the test."""
    model = save_and_load(make_v32("v32", seed=3, index_n_heads=1), tmp_path / "one-head", torch.float32)
    with pytest.raises(pytest.fail.Exception, match="near-tie at the k-th index score"):
        check_top_k_margins(model, tokens_of(30, seed=6), BLOCK_SIZE)
