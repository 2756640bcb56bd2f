"""Sampling with drafts keeps the target distribution: a chi-square test over 20,000 requests.

Each request samples three tokens after one prompt, with its own seed, on a model of 6
tokens with drafts (k = 2): the second and third tokens come from verify rows, after
accepted or rejected drafts. The expected count of each (x1, x2, x3) is computed from the
model's own logits (p(x1) p(x2 | x1) p(x3 | x1, x2)). The threshold was fixed before the
test first ran: the chi-square quantile at 1 - 1e-3 (a false alarm once in a thousand
seeds' worth), over cells whose expected count is at least 5 (the rest pooled into one).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import mla_func as mf
from support.mtp_checkpoints import mtp_checkpoint

VOCAB = 6
SAMPLES = 20_000
PROMPT = [2]
ALPHA = 1e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, path = mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "v3", seed=21, vocab_size=VOCAB, echo=True,
                             num_hidden_layers=1)
    return mf.load_model(path, mtp=True, dtype=torch.float32, device="cpu")


def _engine(model, k):
    return mf.Engine(model, block_size=4, num_blocks=2200, max_num_seqs=1024, max_num_batched_tokens=4096,
                     speculative_tokens=k)


def _exact(model, temperature: float = 1.0) -> dict[tuple[int, ...], float]:
    engine = mf.Engine(model, block_size=4, num_blocks=16)

    def next_probs(ids):
        return torch.softmax(engine.score(ids)[-1].double() / temperature, dim=-1).tolist()

    p1 = next_probs(PROMPT)
    out = {}
    for x1 in range(VOCAB):
        p2 = next_probs(PROMPT + [x1])
        for x2 in range(VOCAB):
            p3 = next_probs(PROMPT + [x1, x2])
            for x3 in range(VOCAB):
                out[(x1, x2, x3)] = p1[x1] * p2[x2] * p3[x3]
    return out


def test_sampled_tokens_with_drafts_follow_the_model(model):
    params = [mf.SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(SAMPLES)]
    engine = _engine(model, 2)
    got = [c.token_ids for c in engine.generate([PROMPT] * SAMPLES, params)]
    stats = engine.speculative_stats
    assert 0 < stats.accepted < stats.drafted

    counts = Counter(got)
    statistic, df = _chi_square(counts, _exact(model))
    assert df > 30
    assert _chi_square_p_value(statistic, df) > ALPHA
    # The same samples are far from a slightly different distribution: the test has power.
    statistic, df = _chi_square(counts, _exact(model, temperature=1.1))
    assert _chi_square_p_value(statistic, df) < ALPHA

    # The drafts change no token: the same seeds without drafts give the same samples.
    head = 2000
    plain = [c.token_ids for c in _engine(model, 0).generate([PROMPT] * head, params[:head])]
    assert plain == got[:head]


def _chi_square_p_value(statistic: float, df: int) -> float:
    """P(X >= statistic) for X chi-square with df degrees of freedom: the regularised upper
    incomplete gamma function Q(df / 2, statistic / 2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _chi_square(counts: Counter, exact: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """(Pearson's statistic, degrees of freedom) of `counts` against SAMPLES draws from `exact`,
    cells of expected count below 5 pooled into one."""
    assert set(counts) <= set(exact)
    cells = list(itertools.product(range(VOCAB), repeat=3))
    big = [c for c in cells if SAMPLES * exact[c] >= 5]
    small = [c for c in cells if SAMPLES * exact[c] < 5]
    bins = [(counts[c], SAMPLES * exact[c]) for c in big]
    if small:
        bins.append((sum(counts[c] for c in small), SAMPLES * sum(exact[c] for c in small)))
    return sum((o - e) ** 2 / e for o, e in bins), len(bins) - 1
