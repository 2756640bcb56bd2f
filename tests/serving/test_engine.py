"""The engine: greedy outputs independent of scheduling, seeded sampling, bad input, scoring."""

from __future__ import annotations

import gc
import random

import pytest

import mla_func as mf
from mla_func.serving.engine import RequestError
from mla_func.serving.sampling import SamplingParams
from support.mla_reference import make_reference, reference_logits, rel_err, save_reference
from support.engine_checks import (GREEDY, assert_greedy_equals_generate, assert_prefix_hits_keep_tokens,
                                    assert_scheduling_keeps_tokens, engine, tokens)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = make_reference("v3-qlora-noaux", seed=11)
    return model, mf.load_model(save_reference(model, tmp_path_factory.mktemp("engine")), device="cpu")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(97) for _ in range(rng.randrange(1, 30))] for _ in range(6)]


def test_greedy_equals_transformers_generate(reference, prompts):
    assert_greedy_equals_generate(*reference, prompts)


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_mixed=False),
        dict(long_prefill_token_threshold=1),
        dict(long_prefill_token_threshold=7),
        dict(long_prefill_token_threshold=None),
        dict(enable_prefix_caching=False),
        dict(num_blocks=12),  # tight: forces preemption and recompute
    ],
    ids=["unmixed", "chunk1", "chunk7", "unlimited", "no-prefix-cache", "preempting"],
)
def test_greedy_outputs_do_not_depend_on_scheduling(reference, prompts, settings):
    assert_scheduling_keeps_tokens(reference[1], prompts, settings)


def test_prefix_caching_reuses_blocks_and_keeps_outputs(reference, prompts):
    shared = prompts[0] + prompts[1] + prompts[2]
    assert_prefix_hits_keep_tokens(reference[1], [shared + [5], shared + [6, 7], shared])


def test_seeded_sampling_is_independent_of_batch_mates(reference, prompts):
    _, model = reference
    target = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tokens(engine(model).generate([prompts[3]], target))[0]
    rng = random.Random(5)
    others = [[rng.randrange(97) for _ in range(rng.randrange(2, 20))] for _ in range(16)]
    mates = [SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randrange(1, 15), ignore_eos=True) for i in range(16)]
    batch = others[:7] + [prompts[3]] + others[7:]
    params = mates[:7] + [target] + mates[7:]
    together = tokens(engine(model, max_num_seqs=8, long_prefill_token_threshold=5).generate(batch, params))[7]
    assert together == alone
    assert len(set(tokens(engine(model).generate([prompts[3]] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2, 3)])))) > 1


def test_each_bad_request_fails_alone(reference, prompts):
    _, model = reference
    e = engine(model, num_blocks=20, max_model_len=200)
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cases = [
        ([], good, "prompt is empty"),
        ([1] * 200, good, "maximum length is 200"),
        ([3, 97, -1], good, r"token ids must be in \[0, 97\)"),
        ([1, 2], dict(max_tokens=0), "max_tokens must be an int >= 1"),
        ([1, 2], dict(temperature=-0.5), "temperature must be a finite number >= 0"),
        ([1, 2], dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        ([1, 2], dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ([1, 2], dict(top_k=-1), "top_k must be an int >= 0"),
        ([1] * 150, dict(max_tokens=20), "usable blocks"),  # needs more blocks than the whole cache
    ]
    batch = [prompts[0]] + [c[0] for c in cases] + [prompts[1]]
    params = [good] + [c[1] for c in cases] + [good]
    results = e.generate(batch, params)
    for result, (_, _, message) in zip(results[1:-1], cases):
        assert result.finish_reason == "error"
        with pytest.raises(RequestError, match=message):
            result.raise_for_error()
    want = tokens(engine(model).generate([prompts[0], prompts[1]], good))
    assert tokens([results[0], results[-1]]) == want
    assert e.scheduler.allocator.num_free_blocks == e.scheduler.allocator.num_usable_blocks  # nothing leaked


def test_streaming_yields_the_same_tokens(reference, prompts):
    _, model = reference
    e = engine(model)
    streamed: dict[int, list[int]] = {}
    done = {}
    for event in e.generate_stream(prompts[:3], GREEDY):
        streamed.setdefault(event.index, []).append(event.token_id)
        if event.completion is not None:
            done[event.index] = event.completion
    assert [tuple(streamed[i]) for i in range(3)] == [done[i].token_ids for i in range(3)]
    assert [done[i].token_ids for i in range(3)] == tokens(engine(model).generate(prompts[:3], GREEDY))


def test_an_abandoned_stream_frees_its_blocks(reference, prompts):
    _, model = reference
    e = engine(model)
    stream = e.generate_stream(prompts, GREEDY)
    next(stream)
    stream.close()
    assert not e.scheduler.has_unfinished()
    assert tokens(e.generate(prompts[:1], GREEDY)) == tokens(engine(model).generate(prompts[:1], GREEDY))


def test_score_returns_every_position(reference, prompts):
    hf, model = reference
    ids = prompts[0] + prompts[1] + prompts[2]
    e = engine(model, max_num_batched_tokens=16)  # several chunks
    got = e.score(ids)
    assert got.shape == (len(ids), model.config.vocab_size)
    assert rel_err(got, reference_logits(hf, ids)) <= 1e-4
    with pytest.raises(ValueError, match="token_ids is empty"):
        e.score([])


def test_warmup_without_graphs_captures_nothing_and_changes_nothing(reference, prompts):
    model = reference[1]
    warmed = engine(model)
    assert warmed.warmup(progress=False, freeze_gc=False) == 0  # no CUDA here: every step is eager
    assert any(o is warmed for o in gc.get_objects())
    assert warmed.warmup(progress=False) == 0
    # The engine, and all that was alive with it, is out of the collector's walks (unfrozen by the conftest).
    assert not any(o is warmed for o in gc.get_objects())
    params = mf.SamplingParams(temperature=0.0, max_tokens=5)
    assert [c.token_ids for c in warmed.generate(prompts, params)] == \
        [c.token_ids for c in engine(model).generate(prompts, params)]
