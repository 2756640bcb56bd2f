"""DeepSeek-V3.2 sparse attention against transformers' DeepseekV32ForCausalLM on every path.

index_topk is 8 and prompts run 20 to 60 tokens, so the indexer really selects;
every test's tokens pass `check_top_k_margins` first (a near-tie at the k-th
index score fails loudly instead of making the oracle's choice a coin flip).
"""

from __future__ import annotations

import random

import pytest
import torch

import mla_func as mf
from support.hand_plans import Seq, blocks, mixed_step_and_alone, prefill_in_chunks, prefill_plan, prefill_then_decode, run
from support.dsa_reference import check_top_k_margins, make_v32, save_and_load
from support.mla_reference import reference_logits, rel_err

BLOCK_SIZE = 4
PROMPT = 37
DECODE_STEPS = 16
TOL = {torch.float32: 1e-4, torch.float64: 1e-5}
SELF_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
CASES = [("v32", torch.float32), ("v32", torch.float64), ("v32-yarn", torch.float32)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{v}-{str(d)[6:]}" for v, d in CASES])
def pair(request, tmp_path_factory):
    variant, dtype = request.param
    reference = make_v32(variant, dtype=dtype, seed=3)
    return reference, save_and_load(reference, tmp_path_factory.mktemp(variant), dtype), dtype


def fresh_state(model, num_blocks=80):
    return mf.init_state(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)


def random_tokens(n, vocab, seed):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def checked_tokens(model, n, seed):
    tokens = random_tokens(n, model.config.vocab_size, seed)
    check_top_k_margins(model, tokens, BLOCK_SIZE)
    return tokens


def test_one_shot_prefill_matches_transformers(pair):
    reference, model, dtype = pair
    tokens = checked_tokens(model, PROMPT, seed=1)
    want = reference_logits(reference, tokens)
    got, _ = prefill_in_chunks(model, fresh_state(model), Seq(blocks(0, 12)), tokens, chunk=PROMPT)
    assert got.shape == want.shape
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_equals_one_shot(pair, chunk):
    _, model, dtype = pair
    tokens = random_tokens(PROMPT, model.config.vocab_size, seed=2)
    one_shot, _ = prefill_in_chunks(model, fresh_state(model), Seq(blocks(0, 12)), tokens, chunk=PROMPT)
    chunked, _ = prefill_in_chunks(model, fresh_state(model), Seq(blocks(1, 12)), tokens, chunk=chunk)
    assert rel_err(chunked, one_shot) <= SELF_TOL[dtype]


def test_prefill_then_decode_matches_transformers_full_forward(pair):
    """Teacher forcing: 16 decode steps against one causal pass over the same tokens."""
    reference, model, dtype = pair
    tokens = checked_tokens(model, PROMPT + DECODE_STEPS, seed=3)
    want = reference_logits(reference, tokens)
    got, _ = prefill_then_decode(model, fresh_state(model), Seq(blocks(0, 16)), tokens, PROMPT)
    assert rel_err(got, want) <= TOL[dtype]
    assert rel_err(got[PROMPT:], want[PROMPT:]) <= TOL[dtype]


def test_mixed_batch_equals_separate_runs(pair):
    """Two sequences decoding while two others prefill, against each run alone."""
    _, model, dtype = pair
    vocab = model.config.vocab_size
    prompts = [random_tokens(n, vocab, seed=10 + n) for n in (29, 5, 23, 41)]
    next_tokens = [random_tokens(1, vocab, seed=20 + i)[0] for i in range(2)]
    together, alone = mixed_step_and_alone(model, lambda: fresh_state(model), prompts, next_tokens, 12, all_logits=True)
    for got, want in zip(together, alone):
        assert rel_err(got, want) <= SELF_TOL[dtype]


def test_logits_do_not_depend_on_batch_mates(pair):
    _, model, dtype = pair
    vocab = model.config.vocab_size
    target = random_tokens(31, vocab, seed=30)
    alone, _ = run(model, fresh_state(model), mf.StepPlan(prefill=(prefill_plan(Seq(blocks(0, 12)), target),)))
    for trial in range(2):
        rng = random.Random(trial)
        mates = [random_tokens(rng.randrange(1, 40), vocab, seed=40 + 7 * trial + j) for j in range(3)]
        seqs = [prefill_plan(Seq(blocks(j + 1, 12)), m) for j, m in enumerate(mates)]
        seqs.insert(trial, prefill_plan(Seq(blocks(0, 12)), target))
        logits, _ = run(model, fresh_state(model), mf.StepPlan(prefill=tuple(seqs)))
        start = sum(len(m) for m in mates[:trial])
        assert rel_err(logits[start:start + len(target)], alone) <= SELF_TOL[dtype]


def test_verify_rows_equal_prefill_with_context(pair):
    """Decode rows of 3 causal query tokens per sequence (speculative verification) = the same tokens prefilled."""
    _, model, dtype = pair
    vocab, q_len = model.config.vocab_size, 3
    contexts = [17, 6, 25]
    tables = [blocks(i, 12) for i in range(3)]
    state = fresh_state(model)
    prompts = [random_tokens(n, vocab, seed=50 + n) for n in contexts]
    context = mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple(p), 0, t, 0) for p, t in zip(prompts, tables)))
    _, state = mf.forward(model.params, state, *mf.plan_step(model.config, state, context))
    queries = [tuple(random_tokens(q_len, vocab, seed=60 + i)) for i in range(3)]
    outs = []
    for plan in (mf.StepPlan(decode=tuple(mf.SeqPlan(q, n, t, q_len) for q, n, t in zip(queries, contexts, tables)),
                             decode_q_len=q_len),
                 mf.StepPlan(prefill=tuple(mf.SeqPlan(q, n, t, q_len) for q, n, t in zip(queries, contexts, tables)))):
        batch, mode = mf.plan_step(model.config, state, plan)
        logits, _ = mf.forward(model.params, state, batch, mode, copy=True)
        outs.append(logits[: mode.num_logits])
    assert outs[0].shape == outs[1].shape == (9, vocab)
    assert rel_err(outs[0], outs[1]) <= SELF_TOL[dtype]
