"""The engine's online API: requests added and aborted between iterations, n samples of a prompt."""

from __future__ import annotations

import pytest

import mla_func as mf
from mla_func.serving.requests import RequestError

GREEDY = mf.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", device="cpu")


def engine(model):
    return mf.Engine(model, block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, graphs=False)


def run(e):
    events = []
    while e.has_unfinished():
        events += e.iterate()
    return events


def test_added_while_running_equals_generate(model):
    offline = engine(model).generate([[1, 2, 3], [4, 5, 6, 7]], GREEDY)
    e = engine(model)
    (first,) = e.add_request([1, 2, 3], GREEDY)
    events = e.iterate() + e.iterate()
    (second,) = e.add_request([4, 5, 6, 7], GREEDY, index=1)
    events += run(e)
    done = {ev.request_id: ev.completion for ev in events if ev.completion is not None}
    assert done[first].token_ids == offline[0].token_ids and done[second].token_ids == offline[1].token_ids
    assert [ev.token_id for ev in events if ev.request_id == second] == list(offline[1].token_ids)
    assert e.num_blocks_in_use == 0 and e.iterate() == []


def test_abort_frees_blocks_at_once_and_stops_events(model):
    e = engine(model)
    (kept,) = e.add_request([1, 2, 3], GREEDY)
    (aborted,) = e.add_request([9, 8, 7, 6, 5], GREEDY)
    e.iterate()
    held = e.num_blocks_in_use
    assert e.abort(aborted) and e.num_blocks_in_use < held
    assert not e.abort(aborted) and not e.abort(12345)
    events = run(e)
    assert {ev.request_id for ev in events} == {kept}
    assert e.num_blocks_in_use == 0


def test_n_samples_seeded_and_first_equals_n1(model):
    params = mf.SamplingParams(temperature=1.0, max_tokens=6, seed=3, n=3, ignore_eos=True)
    got = engine(model).generate([[1, 2, 3]], params)
    again = engine(model).generate([[1, 2, 3]], params)
    assert [c.choice for c in got] == [0, 1, 2] and [c.token_ids for c in got] == [c.token_ids for c in again]
    assert len({c.token_ids for c in got}) > 1
    alone = engine(model).generate([[1, 2, 3]], mf.SamplingParams(temperature=1.0, max_tokens=6, seed=3,
                                                                   ignore_eos=True))[0]
    assert got[0].token_ids == alone.token_ids
    with pytest.raises(ValueError, match=r"SamplingParams\.n"):
        mf.SamplingParams(n=0)


def test_bad_request_refused_by_name_and_not_queued(model):
    e = engine(model)
    with pytest.raises(RequestError, match="token ids must be in"):
        e.add_request([999999], GREEDY)
    assert not e.has_unfinished()


def test_add_request_refused_while_generate_stream_runs(model):
    e = engine(model)
    stream = e.generate_stream([[1, 2, 3]], GREEDY)
    next(stream)
    with pytest.raises(RuntimeError, match="generate_stream is running"):
        e.add_request([1, 2], GREEDY)
    stream.close()
    assert e.num_blocks_in_use == 0 and e.add_request([1, 2], GREEDY)
