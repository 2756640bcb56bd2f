"""Repetition / presence / frequency penalties and min_tokens: the math, the engine, batch invariance."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

import mla_func as mf
from mla_func.serving.engine import Engine
from mla_func.serving.penalties import adjust_logits
from mla_func.serving.requests import CheckedRequest
from mla_func.serving.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return mf.load_model("tiny", device="cpu")


def engine(model, **kwargs):
    settings = dict(block_size=4, num_blocks=80, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96)
    return Engine(model, **{**settings, **kwargs})


def tokens(completions):
    return [c.raise_for_error().token_ids for c in completions]


def expected_logits(logits, prompt, output, params, stop):
    """One row, in plain Python floats: transformers' repetition penalty, OpenAI's additive ones, min_tokens."""
    row = list(logits)
    seen = set(prompt) | set(output)
    for v in range(len(row)):
        x = row[v]
        if v in seen:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        count = output.count(v)
        x -= params.frequency_penalty * count + params.presence_penalty * (1 if count else 0)
        if len(output) < params.min_tokens and v in stop:
            x = -math.inf
        row[v] = x
    return row


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 40),
    rows=st.integers(1, 6),
    data=st.data(),
)
def test_adjusted_logits_match_a_plain_computation(vocab, rows, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    logits = torch.randn(rows, vocab, generator=g) * 4
    requests, outputs = [], []
    for i in range(rows):
        ids = st.lists(st.integers(0, vocab - 1), max_size=12)
        params = SamplingParams(
            repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.3, 2.0, 7.5])),
            presence_penalty=data.draw(st.sampled_from([0.0, 0.4, -1.0, 2.5])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 0.3, -0.7, 1.5])),
            min_tokens=data.draw(st.integers(0, 5)),
            max_tokens=16,
        )
        stop = tuple(data.draw(st.lists(st.integers(0, vocab - 1), max_size=min(3, vocab - 1), unique=True)))
        requests.append(CheckedRequest(i, tuple(data.draw(ids.filter(bool))), params, stop))
        outputs.append(data.draw(ids))
    got = adjust_logits(logits, requests, outputs)
    for i, (r, out) in enumerate(zip(requests, outputs)):
        want = expected_logits(logits[i].tolist(), r.prompt_token_ids, out, r.params, r.stop_token_ids)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=g) * 3
    seqs = [[1, 5, 5, 9, 49], [0, 2], [7, 7, 7, 30, 31, 32]]
    for penalty in (1.3, 0.6):
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        requests = [CheckedRequest(i, tuple(s[:2]), SamplingParams(repetition_penalty=penalty), ()) for i, s in
                    enumerate(seqs)]
        ours = adjust_logits(logits, requests, [s[2:] for s in seqs])
        for i, s in enumerate(seqs):
            theirs = processor(torch.tensor([s]), logits[i : i + 1].clone())
            torch.testing.assert_close(ours[i : i + 1], theirs, rtol=1e-6, atol=1e-6)


def test_default_params_leave_the_logits_untouched():
    logits = torch.randn(2, 10)
    requests = [CheckedRequest(i, (1, 2), SamplingParams(), (1,)) for i in range(2)]
    assert adjust_logits(logits, requests, [[3], []]) is logits


def test_greedy_with_penalties_follows_the_plain_computation_step_by_step(tiny):
    """The engine's greedy tokens equal argmax of score()'s logits penalised by hand, one step at a time."""
    prompt = [7, 7, 9, 100, 7, 200]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8,
                            presence_penalty=0.5, frequency_penalty=0.9, min_tokens=4, stop_token_ids=(3, 4))
    e = engine(tiny)
    got = tokens(e.generate([prompt], params))[0]
    output: list[int] = []
    for _ in range(params.max_tokens):
        last = e.score(prompt + output)[-1].tolist()
        row = expected_logits(last, prompt, output, params, params.stop_token_ids)
        output.append(max(range(len(row)), key=row.__getitem__))
        if output[-1] in params.stop_token_ids:
            break
    assert list(got) == output
    assert got != tokens(engine(tiny).generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                                        ignore_eos=True)))[0]


def test_a_huge_frequency_penalty_never_repeats_an_output_token(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=1e6)
    for out in tokens(engine(tiny).generate([[5, 6], [7], [1, 2, 3]], params)):
        assert len(out) == 40 and len(set(out)) == 40


def test_min_tokens_holds_back_stop_tokens_and_eos(tiny):
    e = engine(tiny)
    prompt = [11, 12, 13]
    free = tokens(e.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))[0]
    stop = (free[0], free[2])
    stopped = e.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stop))[0]
    assert stopped.token_ids == free[:1] and stopped.finish_reason == "stop"
    held = e.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stop, min_tokens=5))[0]
    assert len(held.token_ids) >= 5
    assert not set(held.token_ids[:4]) & {*stop, *tiny.config.eos_token_ids}
    sampled = e.generate([prompt] * 8, [SamplingParams(max_tokens=6, min_tokens=6, seed=s,
                                                        stop_token_ids=tuple(range(2, 500))) for s in range(8)])
    for c in sampled:  # only ids 0 and 500..511 may be drawn (1 is eos)
        assert len(c.token_ids) == 6 and all(t == 0 or t >= 500 for t in c.token_ids)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_seeded_penalised_request_does_not_depend_on_its_batch_mates(tiny, temperature):
    rng = random.Random(3)
    target = SamplingParams(temperature=temperature, seed=99, max_tokens=14, ignore_eos=True, repetition_penalty=1.4,
                            presence_penalty=0.3, frequency_penalty=0.6, min_tokens=5, top_k=50)
    prompt = [rng.randrange(512) for _ in range(9)]
    alone = tokens(engine(tiny).generate([prompt], target))[0]
    others = [[rng.randrange(512) for _ in range(rng.randrange(1, 20))] for _ in range(11)]
    mates = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randrange(1, 15),
                            repetition_penalty=rng.choice([1.0, 2.0]), frequency_penalty=rng.choice([0.0, -0.5]),
                            min_tokens=rng.randrange(0, 2)) for i in range(11)]
    batch, params = others[:5] + [prompt] + others[5:], mates[:5] + [target] + mates[5:]
    together = tokens(engine(tiny, num_blocks=30, long_prefill_token_threshold=5).generate(batch, params))[5]
    assert together == alone


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_a_seeded_penalised_request_keeps_its_tokens_among_others_and_without_graphs(dtype):
    model = mf.load_model("tiny", dtype=dtype, device="cuda", seed=7)
    rng = random.Random(8)
    target = SamplingParams(temperature=0.8, seed=1234, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.2, min_tokens=10, stop_token_ids=(3,), top_p=0.9)
    prompt = [rng.randrange(512) for _ in range(13)]
    others = [[rng.randrange(512) for _ in range(rng.randrange(1, 40))] for _ in range(15)]
    mates = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randrange(1, 25),
                            frequency_penalty=rng.choice([0.0, 0.5])) for i in range(15)]
    alone = tokens(engine(model).generate([prompt], target))[0]
    eager = tokens(engine(model, graphs=False).generate([prompt], target))[0]
    batch, params = others[:9] + [prompt] + others[9:], mates[:9] + [target] + mates[9:]
    together = tokens(engine(model, max_num_seqs=16).generate(batch, params))[9]
    assert alone == eager == together
