"""Hostile requests: each fails alone with a RequestError naming it, and the engine stays usable after it.

"Usable" is checked the same way after every case: nothing is queued, every
block is free, and the next generate gives the tokens a fresh engine gives.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from mla_func.serving.engine import Engine, RequestError
from mla_func.serving.sampling import SamplingParams, sample

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROBE = [[3, 1, 4, 1, 5], [9, 2, 6]]


@pytest.fixture(scope="module")
def tiny():
    return mf.load_model("tiny", device="cpu")  # no tokenizer, vocab 512, eos 1


@pytest.fixture(scope="module")
def demo():
    return mf.load_model("demo", device="cpu")  # a tokenizer that adds a BOS token


def engine(model, **kwargs):
    settings = dict(block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    return Engine(model, **{**settings, **kwargs})


def tokens(completions):
    return [c.raise_for_error().token_ids for c in completions]


def assert_usable(e, model):
    assert not e.scheduler.has_unfinished()
    allocator = e.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    allocator.check_invariants({})
    assert tokens(e.generate(PROBE, GREEDY)) == tokens(engine(model).generate(PROBE, GREEDY))


def error_of(completion):
    assert completion.finish_reason == "error" and completion.token_ids == ()
    assert isinstance(completion.error, RequestError)
    return str(completion.error)


# ---- item 1: a stream closed while it yields the error events of bad requests ----------------------


@pytest.mark.parametrize("events_read", [1, 2, 3, 5])
def test_closing_a_stream_during_or_after_its_error_events_frees_everything(tiny, events_read):
    e = engine(tiny)
    stream = e.generate_stream([[5, 6], [], [7, 8], [2.5]], SamplingParams(max_tokens=4))
    first = [next(stream) for _ in range(events_read)]
    assert [ev.index for ev in first[:2]] == [1, 3][:events_read]  # the two bad requests come first
    stream.close()
    assert_usable(e, tiny)


def test_a_stream_never_started_holds_nothing(tiny):
    e = engine(tiny)
    e.generate_stream([[5, 6]], GREEDY)  # created, never iterated: nothing is queued
    assert_usable(e, tiny)


# ---- item 2: a check that raised something else escaped with requests queued ------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ([1, float("inf")], r"request 1: token ids must be ints, got inf \(float\) at position 1"),
        ([1, float("nan")], r"request 1: token ids must be ints, got nan \(float\) at position 1"),
        ([1, 10**400], r"request 1: token ids must be in \[0, 512\), got \[<an int of 1329 bits>\]"),
        ({1: 2}, "request 1: the prompt must be a string or a list/tuple/range of token ids, got dict"),
        (None, "request 1: the prompt must be a string or a list/tuple/range of token ids, got NoneType"),
        (7, "request 1: the prompt must be a string or a list/tuple/range of token ids, got int"),
        (b"ab", "got bytes"),
        (torch.tensor([1.0, 2.0]), r"1-D of an integer dtype, got \(2,\) torch.float32"),
    ],
)
def test_bad_prompts_fail_alone_by_name(tiny, bad, message):
    e = engine(tiny)
    got = e.generate([[5, 6], bad, [7, 8]], GREEDY)
    assert tokens([got[0], got[2]]) == tokens(engine(tiny).generate([[5, 6], [7, 8]], GREEDY))
    error_of(got[1])  # in the completion, not raised
    with pytest.raises(RequestError, match=message):
        got[1].raise_for_error()
    assert_usable(e, tiny)


@pytest.mark.parametrize(
    "bad, message",
    [
        (5, "params must be a SamplingParams, a mapping of its fields or None, got int"),
        ("greedy", "got str"),
        ({"temperature": "hot"}, r"SamplingParams.temperature must be a finite number >= 0 \(and <= 1e6\), got 'hot'"),
        ({"temperature": 10**400}, "temperature .* got <an int of 1329 bits>"),
        ({"temperatur": 0.5}, r"unknown SamplingParams fields \['temperatur'\]"),
        ({3: 0.5}, r"unknown SamplingParams fields \[3\]"),
        ({"stop_token_ids": [1]}, "stop_token_ids must be a tuple of ints >= 0"),
        ({"stop_token_ids": (512,)}, r"stop_token_ids must be in \[0, 512\), got \[512\]"),
        ({"stop_token_ids": (10**30,)}, r"stop_token_ids must be in \[0, 512\), got \[<an int of 100 bits>\]"),
        ({"seed": 2**63}, r"seed must be None or an int in \[0, 2\*\*63\)"),
        ({"max_tokens": True}, "max_tokens must be an int >= 1, got True"),
        ({"top_p": float("nan")}, r"top_p must be in \(0, 1\], got nan"),
        ({"min_tokens": 9, "max_tokens": 4}, r"min_tokens must be an int in \[0, max_tokens=4\], got 9"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number in \[1e-6, 1e6\]"),
        ({"presence_penalty": float("inf")}, r"presence_penalty must be a number in \[-1e6, 1e6\]"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a number"),
    ],
)
def test_bad_params_fail_alone_by_name(tiny, bad, message):
    e = engine(tiny)
    got = e.generate([[5, 6], [1, 2], [7, 8]], [GREEDY, bad, GREEDY])
    assert tokens([got[0], got[2]]) == tokens(engine(tiny).generate([[5, 6], [7, 8]], GREEDY))
    with pytest.raises(RequestError, match="request 1: .*" + message):
        got[1].raise_for_error()
    assert_usable(e, tiny)


def test_none_in_a_params_list_means_the_defaults(tiny):
    e = engine(tiny)
    got = e.generate([[5, 6], [7, 8]], [SamplingParams(seed=3, ignore_eos=True), None])
    assert [c.finish_reason for c in got] != ["error", "error"] and got[1].error is None
    assert_usable(e, tiny)


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        (5, None, "prompts must be a list of prompts"),
        ({"a": 1}, None, "prompts must be a list of prompts"),
        ([[1], [2]], [GREEDY], r"params: expected one per prompt \(2\), got 1"),
        ([[1], [2]], 3.5, "params must be a SamplingParams, a mapping of its fields, None, or a list"),
    ],
)
def test_a_malformed_call_raises_before_anything_runs(tiny, prompts, params, message):
    e = engine(tiny)
    with pytest.raises(RequestError, match=message) as info:
        e.generate(prompts, params)
    assert info.value.index is None
    assert_usable(e, tiny)


# ---- item 3: top_k of 2**63 and more -----------------------------------------------------------------


@pytest.mark.parametrize("top_k", [2**63, 2**200, 512, 10**6])
def test_a_top_k_beyond_the_vocabulary_is_off(tiny, top_k):
    e = engine(tiny)
    seeded = dict(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    huge = e.generate([[5, 6], [7, 8]], [SamplingParams(top_k=top_k, **seeded), GREEDY])
    off = engine(tiny).generate([[5, 6], [7, 8]], [SamplingParams(top_k=0, **seeded), GREEDY])
    assert tokens(huge) == tokens(off)
    assert_usable(e, tiny)


# ---- item 4: temperatures so small that logits / T overflows -----------------------------------------


@pytest.mark.parametrize("temperature", [1e-46, 1e-40, 1e-38, 1e-30, 1e-6, 5e-324])
def test_a_tiny_temperature_is_greedy(tiny, temperature):
    e = engine(tiny)
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], [100, 200, 300, 400], [9]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert tokens(e.generate(prompts, params)) == tokens(engine(tiny).generate(prompts, greedy))
    assert_usable(e, tiny)


def test_sample_with_a_subnormal_temperature_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 300, generator=g) * 20
    n = logits.shape[0]
    out = sample(logits, temperature=torch.full((n,), 1e-40), top_k=torch.zeros(n, dtype=torch.int64),
                 top_p=torch.ones(n), seeds=torch.arange(n), positions=torch.arange(n))
    assert torch.equal(out, logits.argmax(-1))


# ---- item 5: coercion, names, limits -------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ([5.9, 6.7], r"token ids must be ints, got 5.9 \(float\) at position 0"),
        ([5, True], r"token ids must be ints, got True \(bool\) at position 1"),
        ([5, "6"], r"token ids must be ints, got '6' \(str\) at position 1"),
        ([5, float("nan")], r"got nan \(float\) at position 1"),
        ([], "the prompt is empty"),
    ],
)
def test_token_ids_are_never_coerced(tiny, bad, message):
    e = engine(tiny)
    got = e.generate([[1, 2], bad], GREEDY)
    with pytest.raises(RequestError, match="request 1: .*" + message):
        got[1].raise_for_error()
    assert_usable(e, tiny)


def test_a_bare_string_is_one_prompt(demo):
    e = engine(demo)
    got = e.generate("a bare string", GREEDY)
    assert len(got) == 1
    assert tokens(got) == tokens(engine(demo).generate(["a bare string"], GREEDY))
    assert got[0].prompt_token_ids == (0, *demo.tokenizer.encode("a bare string").ids[1:])
    assert_usable(e, demo)


def test_text_without_a_tokenizer_and_empty_prompts_fail_alike(tiny, demo):
    got = engine(tiny).generate("a bare string", GREEDY)
    with pytest.raises(RequestError, match="request 0: the prompt is text but the model has no tokenizer"):
        got[0].raise_for_error()
    e = engine(demo)
    empty_text, empty_ids = e.generate(["", []], GREEDY)
    assert error_of(empty_text) == "request 0: the prompt is empty"
    assert error_of(empty_ids) == "request 1: the prompt is empty"
    lone = e.generate(["\ud800"], GREEDY)[0]
    assert "lone surrogate" in error_of(lone)
    assert_usable(e, demo)


def test_a_request_too_big_for_the_cache_is_named_by_its_index_only(tiny):
    e = engine(tiny, num_blocks=6, max_model_len=64)  # 5 usable blocks of 4 tokens
    got = e.generate([[1, 2], [3] * 30, [4, 5]], [GREEDY, SamplingParams(max_tokens=10), GREEDY])
    message = error_of(got[1])
    assert message == ("request 1: needs up to 10 KV blocks (39 tokens) but the cache has only 5 usable blocks "
                       "of 4 tokens")
    assert message.count("request") == 1
    assert got[0].error is None and got[2].error is None
    assert not e.scheduler.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_blocks=0), r"Engine: num_blocks must be an int >= 2, as block 0 is the scratch block, got 0"),
        (dict(num_blocks=1), "num_blocks must be an int >= 2"),
        (dict(max_model_len=0), r"Engine: max_model_len must be an int in \[1, 2048\]"),
        (dict(max_model_len=4096), r"max_model_len must be an int in \[1, 2048\] \(the model's max_position_emb"),
        (dict(max_model_len=2.5), "max_model_len must be an int"),
        (dict(block_size=0), "block_size must be an int >= 1"),
    ],
)
def test_engine_limits_are_refused_not_defaulted(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine(tiny, **kwargs)


def test_stop_ids_outside_the_vocabulary_are_refused(tiny):
    e = engine(tiny)
    got = e.generate([[1, 2], [3, 4]], [GREEDY, SamplingParams(stop_token_ids=(511, 512))])
    assert error_of(got[1]) == "request 1: SamplingParams.stop_token_ids must be in [0, 512), got [512]"
    assert got[0].error is None
    assert_usable(e, tiny)


# ---- score: the same checks, and nothing leaked -----------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "score: token_ids is empty"),
        ([1, 2.0], r"token ids must be ints, got 2.0 \(float\) at position 1"),
        ([1, 512], r"token ids must be in \[0, 512\), got \[512\]"),
        ([1] * 65, "score: 65 tokens exceed max_model_len 64"),
        ([1] * 64, "does not fit the free cache blocks"),  # 16 blocks, 11 usable
        (None, "score: token_ids must be a string or a list/tuple/range of token ids, got NoneType"),
        ("text", "no tokenizer"),
    ],
)
def test_score_refuses_bad_input_and_leaks_nothing(tiny, bad, message):
    e = engine(tiny, num_blocks=12)
    with pytest.raises(RequestError, match=message):
        e.score(bad)
    assert_usable(e, tiny)
    assert torch.equal(e.score([5, 6, 7]), engine(tiny).score([5, 6, 7]))
