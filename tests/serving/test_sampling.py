"""Sampling: greedy, top-k, top-p, the sampled distribution, and the explicit random key."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_func.kernels import ops_for
from mla_func.serving.draws import DrawRows, draw_tokens
from mla_func.serving.requests import CheckedRequest, LiveRequest
from mla_func.serving.sampling import SamplingParams, request_seed, sample, uniform_noise

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def py_mix64(x: int) -> int:
    """splitmix64's finaliser on Python ints (unbounded, masked by hand)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def rows(n, *, temperature=1.0, top_k=0, top_p=1.0, seed=0, positions=None):
    return dict(
        temperature=torch.full((n,), float(temperature)),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), float(top_p)),
        seeds=torch.full((n,), seed, dtype=torch.int64),
        positions=torch.arange(n, dtype=torch.int64) if positions is None else positions,
    )


def test_noise_matches_the_unsigned_64_bit_definition():
    # Seeds and positions that exercise the sign bit, where int64 wraparound and
    # arithmetic right shifts would differ from unsigned arithmetic if mishandled.
    seeds = [0, 1, 12345, (1 << 63) - 1, 0x7F4A7C159E3779B9]
    positions = [0, 7, 1 << 40, 3, (1 << 62) + 5]
    vocab = 9
    got = uniform_noise(torch.tensor(seeds), torch.tensor(positions), vocab)
    for i, (s, p) in enumerate(zip(seeds, positions)):
        key = py_mix64(py_mix64((s + GAMMA) & M64) ^ p)
        for v in range(vocab):
            bits = py_mix64((key + (v + 1) * GAMMA) & M64) >> 41
            assert got[i, v].item() == pytest.approx((bits + 0.5) / 2**23, abs=0)


def test_noise_is_uniform_in_the_open_interval():
    u = uniform_noise(torch.arange(64), torch.arange(64) * 3, 4096)
    assert 0 < u.min().item() and u.max().item() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    # Each tenth of (0, 1) holds about a tenth of the values.
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max().item() < 0.005


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=g)
    out = sample(logits, **rows(32, temperature=0.0, top_k=5, top_p=0.3))
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=3, top_p=1e-6)])
def test_keeping_one_token_is_greedy(filters):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=g) * 3
    out = sample(logits, **rows(64, temperature=1.3, **filters))
    assert torch.equal(out, logits.argmax(-1))


def test_sampled_tokens_stay_in_the_top_k_and_nucleus():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(1, 30, generator=g) * 2
    n = 2000
    logits = base.expand(n, -1)
    probs = torch.softmax(base[0].double() / 0.9, -1).tolist()
    order = sorted(range(30), key=lambda v: -probs[v])
    top5 = set(order[:5])
    nucleus, mass = set(), 0.0
    for v in order:  # smallest prefix of the ranking whose mass reaches 0.6
        nucleus.add(v)
        mass += probs[v]
        if mass >= 0.6:
            break
    out_k = set(sample(logits, **rows(n, temperature=0.9, top_k=5)).tolist())
    out_p = set(sample(logits, **rows(n, temperature=0.9, top_p=0.6)).tolist())
    assert out_k == top5  # all of them are drawn in 2000 tries, and nothing else
    assert out_p == nucleus


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.8)],
)
@pytest.mark.parametrize("vary", ["position", "seed"])
def test_sampled_distribution_matches_softmax(temperature, top_k, top_p, vary):
    vocab, n = 6, 40_000
    base = torch.tensor([1.0, 0.5, -0.3, 0.0, 2.0, -1.0])
    # Expected distribution, computed directly: temperature, then top-k, then top-p, renormalised.
    p = torch.softmax(base.double() / temperature, -1).tolist()
    order = sorted(range(vocab), key=lambda v: -p[v])
    kept = order[: top_k or vocab]
    mass_k = sum(p[v] for v in kept)
    nucleus, mass = [], 0.0
    for v in kept:
        nucleus.append(v)
        mass += p[v] / mass_k
        if mass >= top_p:
            break
    z = sum(p[v] for v in nucleus)
    expected = [p[v] / z if v in nucleus else 0.0 for v in range(vocab)]

    if vary == "position":
        r = rows(n, temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    else:
        r = rows(n, temperature=temperature, top_k=top_k, top_p=top_p, positions=torch.full((n,), 17))
        r["seeds"] = torch.arange(n, dtype=torch.int64) * 7919
    out = sample(base.expand(n, -1), **r)
    freq = (torch.bincount(out, minlength=vocab).double() / n).tolist()
    for v in range(vocab):
        sd = math.sqrt(expected[v] * (1 - expected[v]) / n)
        assert abs(freq[v] - expected[v]) <= 5 * sd + 1e-3, (v, freq, expected)


@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(2, 300),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, (1 << 63) - 1),
    position=st.integers(0, 1 << 40),
    index=st.integers(0, 17),
    data_seed=st.integers(0, 1000),
)
def test_a_row_samples_the_same_token_in_any_batch(vocab, temperature, top_k, top_p, seed, position, index, data_seed):
    g = torch.Generator().manual_seed(data_seed)
    others = 17
    logits = torch.randn(others + 1, vocab, generator=g) * 3
    temps = torch.rand(others + 1, generator=g) * 2
    ks = torch.randint(0, 8, (others + 1,), generator=g)
    ps = torch.rand(others + 1, generator=g).clamp(min=0.05)
    seeds = torch.randint(0, 1 << 62, (others + 1,), generator=g)
    pos = torch.randint(0, 1 << 40, (others + 1,), generator=g)
    temps[index], ks[index], ps[index], seeds[index], pos[index] = temperature, top_k, top_p, seed, position
    batched = sample(logits, temps, ks, ps, seeds, pos)
    alone = sample(logits[index : index + 1], temps[index : index + 1], ks[index : index + 1],
                   ps[index : index + 1], seeds[index : index + 1], pos[index : index + 1])
    assert batched[index] == alone[0]
    # The same rows in reverse order give the same tokens, reversed.
    flipped = sample(logits.flip(0), temps.flip(0), ks.flip(0), ps.flip(0), seeds.flip(0), pos.flip(0))
    assert torch.equal(flipped.flip(0), batched)


def test_same_key_same_token_and_the_key_matters():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(256, 100, generator=g)
    r = rows(256, temperature=1.0, seed=42)
    first = sample(logits, **r)
    assert torch.equal(first, sample(logits.clone(), **r))
    other_seed = sample(logits, **rows(256, temperature=1.0, seed=43))
    other_pos = sample(logits, **rows(256, temperature=1.0, seed=42, positions=torch.arange(256) + 1))
    # With 100 near-uniform choices, another key agrees on a row about 1-5% of the time.
    assert (first == other_seed).float().mean() < 0.2
    assert (first == other_pos).float().mean() < 0.2


def test_sample_checks_shapes():
    logits = torch.zeros(3, 5)
    r = rows(3)
    with pytest.raises(ValueError, match=r"top_p must have shape \[3\]"):
        sample(logits, **{**r, "top_p": torch.ones(4)})
    with pytest.raises(ValueError, match="seeds must be int64, got torch.int32"):
        sample(logits, **{**r, "seeds": r["seeds"].int()})
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        sample(logits[0], **r)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_tokens", 0),
        ("seed", -3),
        ("stop_token_ids", [2]),
        ("ignore_eos", 1),
        ("temperature", 2e6),
        ("temperature", True),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", float("inf")),
        ("frequency_penalty", "0.5"),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("min_tokens", 1.0),
    ],
)
def test_sampling_params_name_the_bad_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .*got {value!r}".replace("[", r"\[")):
        SamplingParams(**{field: value})


def test_request_seed_is_the_given_one_or_a_fresh_draw():
    assert request_seed(SamplingParams(seed=7), random.Random(0)) == 7
    rng = random.Random(0)
    drawn = {request_seed(SamplingParams(), rng) for _ in range(100)}
    assert len(drawn) == 100 and all(0 <= s < 1 << 63 for s in drawn)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_defaults_change_nothing_and_tiny_temperatures_are_greedy():
    params = SamplingParams()
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty, params.min_tokens) == \
        (1.0, 0.0, 0.0, 0)
    assert not params.penalised and SamplingParams(presence_penalty=-0.5).penalised
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("changes, plain", [
    (dict(), True),
    (dict(temperature=0.7), False),
    (dict(repetition_penalty=1.1), False),
    (dict(presence_penalty=0.2), False),
    (dict(frequency_penalty=-0.2), False),
    (dict(min_tokens=1), False),
    (dict(logprobs=0), False),
])
def test_plain_requests_are_drawn_by_the_argmax_of_raw_rows(changes, plain):
    # A step whose rows are all plain takes the argmax of the raw logits; any other setting must take the
    # general draw, which gives the same argmax for greedy plain rows.
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 4, **changes})
    request = CheckedRequest(0, (1, 2, 3), params, (0,))
    assert request.plain is plain
    other = LiveRequest(CheckedRequest(1, (4, 5), SamplingParams(temperature=0.0, max_tokens=4), (0,)), seed=3)
    rows = DrawRows.of([LiveRequest(request, seed=7), other], [3, 2])
    assert rows.plain is plain and rows.index == [0, 1] and rows.seeds == [7, 3] and rows.positions == [3, 2]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    drawn = draw_tokens(logits, rows, penalties=True, ops=ops_for("torch", batch_invariant=False))
    if not changes.get("temperature"):
        assert drawn[1].item() == logits[1].argmax().item()
    if plain:
        assert drawn.tolist() == logits.argmax(dim=-1).tolist()
