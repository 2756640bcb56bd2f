"""Engine-level checks every family's tests run: greedy tokens against transformers' `generate`, tokens
that do not follow scheduling, prefix-cache hits that change nothing (small engines on the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import mla_func as mf
from mla_func.serving.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def engine(model: mf.Model, **kwargs) -> mf.Engine:
    """A small engine (blocks of 4, 200 of them, 4 sequences, 32 tokens a step); `kwargs` override."""
    settings = dict(block_size=4, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=32)
    return mf.Engine(model, **{**settings, **kwargs})


def tokens(completions) -> list[tuple[int, ...]]:
    return [c.raise_for_error().token_ids for c in completions]


def assert_greedy_equals_generate(reference: torch.nn.Module, model: mf.Model, prompts: list[list[int]],
                                  check: Callable[[list[int]], object] = lambda ids: None) -> None:
    """Each prompt's greedy tokens equal transformers' `generate` on it; `check(prompt + tokens)` runs first
    (a family's guard against an ambiguous oracle)."""
    for prompt, got in zip(prompts, tokens(engine(model).generate(prompts, GREEDY))):
        check(prompt + list(got))
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # An explicit mask: otherwise generate treats token 0 (the pad id) in the prompt as padding.
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
        assert list(got) == out[0, len(prompt):].tolist()


def assert_scheduling_keeps_tokens(model: mf.Model, prompts: list[list[int]], settings: dict) -> None:
    """The prompts batched under an engine of `settings` give each prompt's tokens when run alone."""
    alone = [tokens(engine(model).generate([p], GREEDY))[0] for p in prompts]
    assert tokens(engine(model, **settings).generate(prompts, GREEDY)) == alone


def assert_prefix_hits_keep_tokens(model: mf.Model, variants: list[list[int]]) -> None:
    """Prompts sharing a prefix: a second run (served from cached blocks) and a run without prefix caching
    give the first run's tokens."""
    e = engine(model)
    first = tokens(e.generate(variants, GREEDY))
    assert e.scheduler.allocator.num_cached_blocks > 0
    again = tokens(e.generate(variants, GREEDY))
    fresh = tokens(engine(model, enable_prefix_caching=False).generate(variants, GREEDY))
    assert first == again == fresh
