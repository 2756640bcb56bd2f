"""Faults inside an engine iteration: the error reaches the caller and the engine stays usable.

An interrupt or an out-of-memory error is raised once at each point of an iteration. With
drafts (k = 3, so the draft chain runs): the chain's drafter steps, their drawing and
their host sync; the verify step, the drawing of its rows (penalties, the seeded draw)
and the acceptance; the drafter's catch-up step, its drawing and the iteration's host
sync. Without drafts: the step and its drawing. After each, the error is the caller's,
the engine's states are live, no request, draft or block is left behind, and a second
`generate` on the same engine gives exactly the tokens of a fresh engine (greedy and
seeded requests, with prefix-cache hits on what the failed call cached) and `score` its
logits. Without prefix caching the second call also proposes the fresh engine's drafts in
every iteration: the drafter's cache and the pending drafts hold nothing stale.

Also here: the Engine's arguments are type-checked (a truthy string is not a bool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import mla_func as mf
import mla_func.serving.draws
import mla_func.serving.speculative
from mla_func.core.step import Step
from mla_func.serving.speculative import SpeculativeStats

SETTINGS: dict[str, Any] = dict(block_size=4, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=32,
                                long_prefill_token_threshold=6, graphs=False)
SHARED = [7, 8, 9, 10, 11, 12, 13, 14]          # two full blocks: the second call hits what the first cached
PROMPTS = [SHARED + [3, 4, 5], [20, 21, 22], SHARED + [30, 31], [40, 41, 42, 43, 44, 45, 46]]
PARAMS = [
    mf.SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    mf.SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=8, ignore_eos=True, presence_penalty=0.3),
    mf.SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, repetition_penalty=1.2),
    mf.SamplingParams(temperature=0.8, top_p=0.9, seed=12, max_tokens=9, ignore_eos=True),
]
SCORED = SHARED + [1, 2, 3]

# With drafts: "<phase>:<point>", the phase being the step that runs or ran last.
DRAFTED_POINTS = ["chain:step", "chain:sample", "chain:sync", "verify:step", "verify:adjust_logits", "verify:sample",
                  "verify:accepted_lengths", "catch-up:step", "catch-up:sample", "catch-up:sync"]
PLAIN_POINTS = ["plain:step", "plain:adjust_logits", "plain:sample"]
ERRORS = {"interrupt": KeyboardInterrupt, "oom": lambda: RuntimeError("out of memory")}


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", mtp=True, dtype=torch.float64, device="cpu")


@dataclass(frozen=True)
class Run:
    """One generate call's tokens, the drafts of its iterations and their counts, then one score call."""

    tokens: list[tuple[int, ...]]
    drafts: list[tuple[tuple[int, ...], ...]]
    stats: SpeculativeStats
    scored: torch.Tensor


def _run(engine: mf.Engine) -> Run:
    spec = engine._speculative
    drafts: list[tuple[tuple[int, ...], ...]] = []
    before = SpeculativeStats(engine.speculative_stats.drafted, engine.speculative_stats.accepted)
    if spec is not None:
        draft = spec.draft

        def recorded(*args: Any) -> Any:
            verify = draft(*args)
            drafts.append(verify.drafts)
            return verify

        spec.draft = recorded   # an instance attribute: `del` below brings the method back
    try:
        tokens = [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]
    finally:
        if spec is not None:
            del spec.draft
    stats = SpeculativeStats(engine.speculative_stats.drafted - before.drafted,
                             engine.speculative_stats.accepted - before.accepted)
    return Run(tokens, drafts, stats, engine.score(SCORED))


@pytest.fixture(scope="module")
def fresh(model):
    """A fresh engine's run, per (k, prefix caching): made before any test patches a fault in."""
    return {(k, caching): _run(mf.Engine(model, **SETTINGS, speculative_tokens=k, enable_prefix_caching=caching))
            for k, caching in ((0, True), (3, True), (3, False))}


class Fault:
    """Raises `error` at the `at`-th time the engine passes `point` ("<phase>:<what>").

    Steps are told apart by the engine's own: its `step` is the target's ("plain" without
    drafts, else "verify"); a drafter step right after the target's is the catch-up, any
    other one a draft chain step. A function passed is named with the phase of the step last run.
    """

    def __init__(self, engine: mf.Engine, point: str, error: BaseException, at: int):
        self.engine, self.point, self.error, self.at = engine, point, error, at
        self.phase = ""
        self.calls = 0

    def passing(self, what: str) -> None:
        if f"{self.phase}:{what}" == self.point:
            self.calls += 1
            if self.calls == self.at:
                raise self.error

    def step_phase(self, step: Step) -> str | None:
        spec = self.engine._speculative
        if step is self.engine.step:
            return "plain" if spec is None else "verify"
        if spec is not None and step is spec.drafter:
            return "catch-up" if self.phase == "verify" else "chain"
        return None   # another engine's step

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        call = Step.__call__

        def step_call(step: Step, state: Any, batch: Any, mode: Any) -> Any:
            phase = self.step_phase(step)
            if phase is not None:
                self.phase = phase
                self.passing("step")
            return call(step, state, batch, mode)

        monkeypatch.setattr(Step, "__call__", step_call)
        # Every draw, plain or speculative, goes through mla_func.serving.draws.
        points = {mla_func.serving.draws: ("adjust_logits", "sample"),
                  mla_func.serving.speculative: ("accepted_lengths", "to_host")}
        for module, names in points.items():
            for name in names:
                monkeypatch.setattr(module, name, self._wrap(getattr(module, name),
                                                             "sync" if name == "to_host" else name))

    def _wrap(self, fn: Any, what: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.passing(what)
            return fn(*args, **kwargs)
        return wrapped


def _fail_once(model, monkeypatch, point: str, error_kind: str, *, k: int, at: int = 3,
               **settings: Any) -> mf.Engine:
    """An engine whose first generate raised at `point`, checked to have left nothing behind."""
    engine = mf.Engine(model, **{**SETTINGS, **settings}, speculative_tokens=k)
    error = ERRORS[error_kind]()
    fault = Fault(engine, point, error, at)
    fault.install(monkeypatch)
    with pytest.raises(type(error)) as raised:
        engine.generate(PROMPTS, PARAMS)
    assert raised.value is error and fault.calls == at
    assert not engine.state.is_donated
    if engine._speculative is not None:
        assert not engine._speculative.state.is_donated
        assert not engine._speculative.drafts
    assert not engine.scheduler.has_unfinished()
    engine.scheduler.check_invariants()
    allocator = engine.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    return engine


def _check_usable(engine: mf.Engine, want: Run) -> Run:
    got = _run(engine)
    assert got.tokens == want.tokens
    assert torch.equal(got.scored, want.scored)
    allocator = engine.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks
    return got


@pytest.mark.parametrize("error_kind", sorted(ERRORS))
@pytest.mark.parametrize("point", DRAFTED_POINTS)
def test_a_fault_in_a_drafted_iteration_leaves_the_engine_usable(model, fresh, monkeypatch, point, error_kind):
    engine = _fail_once(model, monkeypatch, point, error_kind, k=3)
    assert engine.scheduler.allocator.num_cached_blocks > 0   # the next call hits blocks the failed one cached
    _check_usable(engine, fresh[3, True])


@pytest.mark.parametrize("error_kind", sorted(ERRORS))
@pytest.mark.parametrize("point", PLAIN_POINTS)
def test_a_fault_in_a_plain_iteration_leaves_the_engine_usable(model, fresh, monkeypatch, point, error_kind):
    engine = _fail_once(model, monkeypatch, point, error_kind, k=0)
    _check_usable(engine, fresh[0, True])


@pytest.mark.parametrize("point", DRAFTED_POINTS)
def test_after_a_fault_the_drafts_are_a_fresh_engines(model, fresh, monkeypatch, point):
    # Without prefix caching the second call runs the fresh engine's steps exactly, so equal drafts in
    # every iteration show that no stale draft or drafter cache entry of the failed call is read.
    engine = _fail_once(model, monkeypatch, point, "oom", k=3, enable_prefix_caching=False)
    want = fresh[3, False]
    got = _check_usable(engine, want)
    assert any(len(d) > 1 for row in want.drafts for d in row)   # the chains ran
    assert got.drafts == want.drafts and got.stats == want.stats


def test_the_reported_locked_engine(monkeypatch):
    # The report: the logits adjustment raising on its third call with two drafts left every later call
    # with a donated state. A penalty keeps the adjustment on the path (greedy rows with nothing to adjust
    # skip it).
    tiny = mf.load_model("tiny", mtp=True)
    params = mf.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.1)
    want = mf.Engine(tiny, speculative_tokens=2, graphs=False).generate([[5, 6, 7]], params)[0]
    engine = mf.Engine(tiny, speculative_tokens=2, graphs=False)
    Fault(engine, "verify:adjust_logits", KeyboardInterrupt(), 3).install(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[5, 6, 7]], params)
    assert engine.generate([[5, 6, 7]], params)[0].token_ids == want.token_ids


# ---- argument checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["batch_invariant", "graphs", "enable_mixed", "enable_prefix_caching"])
@pytest.mark.parametrize("value", ["yes", "false", 1, 0, None])
def test_flags_must_be_bools(model, name, value):
    with pytest.raises(ValueError, match=f"^Engine: {name} must be a bool, got {value!r}$"):
        mf.Engine(model, **{**SETTINGS, name: value})


@pytest.mark.parametrize("name, value, message", [
    ("max_num_seqs", 0, "must be an int >= 1, got 0"),
    ("max_num_seqs", "4", "must be an int >= 1, got '4'"),
    ("max_num_seqs", True, "must be an int >= 1, got True"),
    ("max_num_batched_tokens", 32.0, "must be an int >= 1, got 32.0"),
    ("max_num_batched_tokens", -1, "must be an int >= 1, got -1"),
    ("long_prefill_token_threshold", -1, "must be an int >= 0 or None, got -1"),
    ("long_prefill_token_threshold", "6", "must be an int >= 0 or None, got '6'"),
    ("seed", "0", "must be an int, got '0'"),
    ("seed", 1.5, "must be an int, got 1.5"),
    ("seed", False, "must be an int, got False"),
])
def test_int_arguments_are_checked(model, name, value, message):
    with pytest.raises(ValueError, match=f"^Engine: {name} {message}$"):
        mf.Engine(model, **{**SETTINGS, name: value})


@pytest.mark.parametrize("settings", [dict(long_prefill_token_threshold=None), dict(long_prefill_token_threshold=0),
                                      dict(seed=-5), dict(batch_invariant=True, enable_mixed=False)])
def test_valid_arguments_are_taken(model, settings):
    engine = mf.Engine(model, **{**SETTINGS, **settings})
    assert engine.generate([[1, 2, 3]], mf.SamplingParams(temperature=0, max_tokens=2))[0].error is None
