"""Running the engine while recording each request's logits rows by position, for invariance tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

import mla_func as mf
from mla_func.serving.sampling import SamplingParams


@dataclass
class LogitsRecorder:
    """Wraps an engine's step and scheduler: every logits row a request gets, keyed by the
    position it samples (the scheduled row's seq_len), is kept, a copy per row."""

    engine: mf.Engine
    logits: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # request id -> position -> [V]
    preemptions: int = 0
    _scheduled: Any = None

    def __post_init__(self) -> None:
        step, scheduler = self.engine.step, self.engine.scheduler
        schedule = scheduler.schedule

        def recording_schedule():
            self._scheduled = schedule()
            if self._scheduled is not None:
                self.preemptions += len(self._scheduled.preempted)
            return self._scheduled

        recorder = self

        class RecordingStep:
            def __getattr__(self, name: str) -> Any:
                return getattr(step, name)

            def __call__(self, state, batch, mode):
                new_state, out = step(state, batch, mode)
                scheduled = recorder._scheduled
                rows = [i for i, row in enumerate(scheduled.rows) if row.num_logits]
                for k, i in enumerate(rows):
                    per_request = recorder.logits.setdefault(scheduled.request_ids[i], {})
                    per_request[scheduled.rows[i].seq_len] = out.logits[k].detach().float().cpu().clone()
                return new_state, out

        scheduler.schedule = recording_schedule
        self.engine.step = RecordingStep()


def probe_requests(vocab: int, seed: int, *, count: int, max_tokens: int, max_len: int
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
    """`count` probes, half seeded sampled (temperature, top-k, top-p), half greedy; random prompt lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
                             ignore_eos=True) if i < count // 2 else
              SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for i in range(count)]
    return prompts, params


def other_requests(vocab: int, seed: int, *, count: int, probes: list[list[int]], max_tokens: int, max_len: int
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Batch-mates of random lengths; a third of them extend a probe's prompt, so that prefix
    caching serves probes (or them) from shared blocks."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, max_len))]
        prompts.append(rng.choice(probes) + tail if i % 3 == 0 else tail)
        params.append(SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), seed=rng.randrange(10**6),
                                     max_tokens=rng.randrange(1, max_tokens + 1), ignore_eos=True))
    return prompts, params


@dataclass
class ProbeRun:
    tokens: list[tuple[int, ...]]          # per probe
    logits: list[list[torch.Tensor]]       # per probe, the logits row of each generated position
    preemptions: int                       # requests preempted during the run (probes or not)


def run_probes(engine: mf.Engine, probes: tuple[list[list[int]], list[SamplingParams]],
               others: tuple[list[list[int]], list[SamplingParams]], seed: int) -> ProbeRun:
    """Generate probes and others shuffled together, in one generate call."""
    prompts = list(probes[0]) + list(others[0])
    params = list(probes[1]) + list(others[1])
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    recorder = LogitsRecorder(engine)
    first_id = engine.requests_started
    completions = engine.generate([prompts[i] for i in order], [params[i] for i in order])
    where = {original: shuffled for shuffled, original in enumerate(order)}
    tokens, logits = [], []
    for probe in range(len(probes[0])):
        index = where[probe]
        completion = completions[index].raise_for_error()
        tokens.append(completion.token_ids)
        # Request ids are given in call order, counting on from the engine's earlier calls.
        rows = recorder.logits[first_id + index]
        start = len(completion.prompt_token_ids)
        logits.append([rows[start + k] for k in range(len(completion.token_ids))])
    return ProbeRun(tokens, logits, recorder.preemptions)


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> int | None:
    """The first step whose logits rows differ in any bit, or None."""
    for k, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x, y):
            return k
    return None
