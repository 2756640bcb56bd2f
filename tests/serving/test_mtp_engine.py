"""Speculative decoding with the MTP layer: the tokens are those of decoding without drafts.

A tiny random DeepSeek-V3 checkpoint with a vocabulary of 8 tokens and an MTP layer that
guesses well on its repetitive greedy text (`mtp_models.add_mtp_layer(echo=True)`), so
every acceptance path runs (none, some, all accepted,
a stop token inside the accepted drafts, a request's last tokens), in mixed steps with
chunked prefill, prefix caching and preemption by recompute.
"""

from __future__ import annotations

import random

import pytest
import torch

import mla_func as mf
from support.mtp_checkpoints import StepRecorder, check_drafted_run, drafting_engine, drafting_requests, mtp_checkpoint

VOCAB = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, path = mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "v3", seed=11, vocab_size=VOCAB, echo=True)
    return mf.load_model(path, mtp=True, dtype=torch.float64, device="cpu")


def _engine(model, k, **kwargs):
    return drafting_engine(model, k, **kwargs)


def _requests(seed):
    return drafting_requests(seed, VOCAB)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_equal_decoding_without_drafts(model, k):
    prompts, params = _requests(k)
    want = _engine(model, 0).generate(prompts, params)
    engine = _engine(model, k, num_blocks=14)   # tight: preemption by recompute
    seen = StepRecorder(engine)
    got = engine.generate(prompts, params)
    check_drafted_run(engine, seen, got, want, k)
    assert any(c.finish_reason == "stop" for c in got)


def test_prefix_cache_hits_keep_tokens(model):
    prompts, params = _requests(7)
    engine = _engine(model, 2, num_blocks=200)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)     # every full prompt block is a hit now
    want = _engine(model, 0, enable_prefix_caching=False).generate(prompts, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again] == [c.token_ids for c in want]


def test_seeded_request_alone_equals_in_a_batch_of_16(model):
    rng = random.Random(3)
    target = mf.SamplingParams(temperature=0.9, top_k=6, top_p=0.95, seed=1234, max_tokens=14, ignore_eos=True,
                               presence_penalty=0.2)
    prompt = [rng.randrange(VOCAB) for _ in range(7)]
    alone = _engine(model, 2, max_num_seqs=16, max_num_batched_tokens=64).generate([prompt], target)[0]
    others = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))] for _ in range(15)]
    mates = [mf.SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randrange(1, 15), ignore_eos=True)
             for i in range(15)]
    engine = _engine(model, 2, max_num_seqs=16, max_num_batched_tokens=64)
    together = engine.generate(others[:7] + [prompt] + others[7:], mates[:7] + [target] + mates[7:])[7]
    assert together.token_ids == alone.token_ids
    assert engine.speculative_stats.accepted > 0
    # And they are the tokens of plain decoding with that seed.
    assert _engine(model, 0).generate([prompt], target)[0].token_ids == alone.token_ids


def test_speculative_decoding_needs_the_mtp_layer():
    model = mf.load_model("tiny", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"load_model\(\.\.\., mtp=True\)"):
        mf.Engine(model, speculative_tokens=2)
    with pytest.raises(ValueError, match=r"speculative_tokens must be an int in \[0, 8\]"):
        mf.Engine(model, speculative_tokens=9)


def test_v32_sparse_layers_draft_with_their_own_kind(tmp_path):
    from support.dsa_reference import make_v32
    from support.mtp_checkpoints import add_mtp_layer

    make_v32(seed=4).save_pretrained(tmp_path / "v32")
    add_mtp_layer(tmp_path / "v32", 77, echo=True)
    v32 = mf.load_model(tmp_path / "v32", mtp=True, dtype=torch.float64, device="cpu")
    vocab = v32.config.vocab_size
    prompts = [[1, 2, 3, 4, 5], [7, 6, 5], [i % vocab for i in range(30)], [3] * 17]
    params = mf.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = _engine(v32, 0, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16).generate(prompts, params)
    engine = _engine(v32, 2, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    assert [c.token_ids for c in engine.generate(prompts, params)] == [c.token_ids for c in want]
    assert engine.speculative_stats.accepted > 0


def test_closing_a_stream_frees_blocks_and_pending_drafts(model):
    engine = _engine(model, 2)
    prompts, params = _requests(5)
    stream = engine.generate_stream(prompts, params)
    for _ in range(12):
        next(stream)
    assert engine._speculative.drafts      # drafts wait for the requests' next verify rows
    stream.close()
    assert not engine._speculative.drafts
    allocator = engine.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks
