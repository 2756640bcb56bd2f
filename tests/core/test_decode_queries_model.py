"""Decode rows of several causal query tokens (verify rows) = prefill of the same tokens with context.

The same cache, the same tokens: one step feeds them as a decode segment of
`decode_q_len` tokens per sequence, the other as prefill chunks after the cached
context. Logits of every query token and the cache they write must agree, on the
torch reference, the Triton kernels under the interpreter, and on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.hand_plans import blocks
from support.mla_reference import rel_err

BLOCK_SIZE = 4
CPU_BACKENDS = ["torch", "triton"]
# Triton runs on the GPU where there is one (under the interpreter elsewhere).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _compare(model, backend, device, q_len, contexts, seed, tol):
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    state = mf.init_state(model, num_blocks=64, block_size=BLOCK_SIZE, device=device)
    width = -(-(max(contexts) + q_len) // BLOCK_SIZE)
    tables = [blocks(i, width) for i in range(len(contexts))]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in contexts]
    context = mf.StepPlan(prefill=tuple(mf.SeqPlan(tuple(p), 0, t, 0) for p, t in zip(prompts, tables)))
    _, state = mf.forward(model.params, state, *mf.plan_step(model.config, state, context, backend=backend))
    queries = [tuple(torch.randint(0, vocab, (q_len,), generator=gen).tolist()) for _ in contexts]

    as_decode = mf.StepPlan(decode=tuple(mf.SeqPlan(q, n, t, q_len) for q, n, t in zip(queries, contexts, tables)),
                            decode_q_len=q_len)
    batch, mode = mf.plan_step(model.config, state, as_decode, backend=backend)
    assert mode.kind is mf.SegmentKind.DECODE and mode.num_tokens == q_len * len(contexts)
    decode_logits, decode_state = mf.forward(model.params, state, batch, mode, copy=True)

    as_prefill = mf.StepPlan(prefill=tuple(mf.SeqPlan(q, n, t, q_len) for q, n, t in zip(queries, contexts, tables)))
    batch, mode = mf.plan_step(model.config, state, as_prefill, backend=backend)
    prefill_logits, prefill_state = mf.forward(model.params, state, batch, mode, copy=True)

    n = q_len * len(contexts)
    assert decode_logits.shape[0] == n
    assert rel_err(decode_logits[:n], prefill_logits[:n]) <= tol
    for got, want in zip(decode_state.leaves(), prefill_state.leaves()):
        assert rel_err(got[1:], want[1:]) <= tol  # block 0 is scratch


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("q_len", [2, 3, 4])
def test_verify_rows_equal_prefill_with_context(backend, q_len):
    dtype = torch.float64 if backend == "torch" else torch.float32
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    model = mf.load_model("tiny", dtype=dtype, device=device, seed=31)
    _compare(model, backend, device, q_len, contexts=[5, 1, 9], seed=q_len,
             tol=1e-10 if dtype == torch.float64 else 2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("q_len", [2, 3, 4])
def test_verify_rows_equal_prefill_with_context_gpu(backend, q_len):
    model = mf.load_model("tiny", dtype=torch.float32, device="cuda", seed=32)
    _compare(model, backend, "cuda", q_len, contexts=[17, 3, 30, 8], seed=10 + q_len, tol=2e-4)


def test_decode_rows_must_feed_the_segment_query_length():
    model = mf.load_model("tiny", dtype=torch.float64, device="cpu", seed=33)
    state = mf.init_state(model, num_blocks=16, block_size=BLOCK_SIZE)
    plan = mf.StepPlan(decode=(mf.SeqPlan((1, 2, 3), 4, (1, 2)), mf.SeqPlan((4, 5), 4, (3, 4))), decode_q_len=3)
    with pytest.raises(mf.BatchError, match=r"decode sequence 1: expected 3 tokens \(decode_q_len\)"):
        mf.plan_step(model.config, state, plan)


def test_query_length_is_part_of_the_static_key():
    plan = lambda q: mf.StepPlan(decode=(mf.SeqPlan(tuple(range(1, q + 1)), 4, (1, 2, 3), q),), decode_q_len=q)  # noqa: E731
    groups = (mf.CacheGroup(num_blocks=16, block_size=4),)
    one, two = (mf.ForwardMode.decide(plan(q), cache_groups=groups) for q in (1, 2))
    assert one.static_key != two.static_key and (one.num_tokens, two.num_tokens) == (1, 2)
    assert not one.gather_logits and not two.gather_logits
    # One logits row of two query tokens: the logits rows are gathered.
    last_only = mf.StepPlan(decode=(mf.SeqPlan((1, 2), 4, (1, 2, 3), 1),), decode_q_len=2)
    assert mf.ForwardMode.decide(last_only, cache_groups=groups).gather_logits
