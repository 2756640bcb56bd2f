"""Fuzz: arbitrary Python values as prompts and parameters, streams abandoned at random points.

One engine takes every example in turn, so a request that locked it or leaked
a block would fail the examples after it as well as its own. The only
exception a call may raise is RequestError: with index None from generate /
generate_stream (the call itself is malformed, nothing ran), any index from
score. After every example nothing is queued, every block is free, and a probe
generate gives the tokens a fresh engine gives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_func as mf
from mla_func.serving.engine import Engine, RequestError
from mla_func.serving.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROBE = [[3, 1, 4, 1, 5], "probe text"]
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def new_engine(model):
    # Small limits keep every example short: at most 4 requests of at most 24 tokens each.
    return Engine(model, block_size=4, num_blocks=16, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=24)


@pytest.fixture(scope="module")
def fuzzed():
    model = mf.load_model("demo", device="cpu")  # a tokenizer, so text prompts run too
    engine = new_engine(model)
    probe = [c.raise_for_error().token_ids for c in new_engine(model).generate(PROBE, GREEDY)]
    return engine, probe


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([2**63, 2**64 + 1, -(2**63) - 1, 10**400]),
    st.floats(), st.text(max_size=6), st.sampled_from(["", "\ud800", "x\x00y"]), st.binary(max_size=4),
    st.complex_numbers(allow_nan=True), st.sampled_from([torch.tensor([1, 2]), torch.tensor([[1]]),
                                                         torch.tensor([0.5]), torch.tensor([], dtype=torch.int64)]),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3), st.frozensets(scalars, max_size=3)),
    max_leaves=8,
)
token_lists = st.lists(st.one_of(st.integers(0, 4095), st.integers(-3, 4100), anything), max_size=26)
prompts = st.one_of(st.lists(st.integers(0, 4095), min_size=1, max_size=12), st.text(max_size=20), token_lists,
                    st.tuples(st.integers(0, 9)), st.just(range(3, 9)), anything)
valid_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-45, 1e-39, 1e-6, 0.7, 1.0, 5.0]),
    top_p=st.sampled_from([1.0, 0.9, 1e-9]),
    top_k=st.sampled_from([0, 1, 5, 4096, 2**63, 2**300]),
    max_tokens=st.integers(1, 6),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    stop_token_ids=st.lists(st.integers(0, 4200), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    repetition_penalty=st.sampled_from([1.0, 1e-6, 1.3, 1e6]),
    presence_penalty=st.sampled_from([0.0, -1e6, 0.5, 1e6]),
    frequency_penalty=st.sampled_from([0.0, -2.0, 0.5, 1e6]),
    min_tokens=st.integers(0, 1),
)
param_dicts = st.dictionaries(st.one_of(st.sampled_from(FIELDS), scalars), st.one_of(anything, st.integers(0, 8)),
                              max_size=4)
params_one = st.one_of(st.none(), valid_params, param_dicts, anything)
calls = st.one_of(
    st.tuples(st.lists(prompts, max_size=4), st.one_of(params_one, st.lists(params_one, max_size=4))),
    st.lists(prompts, max_size=4).flatmap(lambda ps: st.tuples(st.just(ps), st.lists(params_one, min_size=len(ps),
                                                                                   max_size=len(ps)))),
    st.tuples(anything, params_one),
)


def check_usable(engine, probe):
    assert not engine.scheduler.has_unfinished()
    allocator = engine.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    allocator.check_invariants({})
    assert [c.raise_for_error().token_ids for c in engine.generate(PROBE, GREEDY)] == probe


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=calls, how=st.sampled_from(["generate", "stream", "score"]), stop_after=st.integers(0, 40))
def test_no_input_locks_leaks_or_escapes(fuzzed, call, how, stop_after):
    engine, probe = fuzzed
    prompts_, params = call
    try:
        if how == "generate":
            completions = engine.generate(prompts_, params)
            assert [c.index for c in completions] == list(range(len(completions)))
            for c in completions:
                assert (c.error is None) == (c.finish_reason != "error")
                assert c.error is None or c.error.index == c.index
        elif how == "stream":
            stream = engine.generate_stream(prompts_, params)
            for n, event in enumerate(stream):
                assert event.completion is None or event.completion.index == event.index
                if n >= stop_after:
                    break
            stream.close()
        else:
            logits = engine.score(prompts_)
            assert torch.isfinite(logits).all()
    except RequestError as e:
        assert how == "score" or e.index is None
    check_usable(engine, probe)
