"""The engine and the command line on a DeepSeek-V3.2 checkpoint: greedy tokens are transformers' own,
whatever the scheduling (chunked prefill, mixed steps, prefix caching)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

import mla_func as mf
from support.dsa_reference import check_top_k_margins, make_v32
from mla_func.serving.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    reference = make_v32("v32", seed=3)
    path = tmp_path_factory.mktemp("v32-engine")
    reference.save_pretrained(path)
    return reference, path, mf.load_model(path, device="cpu")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(97) for _ in range(rng.randrange(20, 40))] for _ in range(3)]


def engine(model, **kwargs):
    settings = dict(block_size=4, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=32)
    return mf.Engine(model, **{**settings, **kwargs})


def tokens(completions):
    return [c.raise_for_error().token_ids for c in completions]


def test_greedy_equals_transformers_generate(checkpoint, prompts):
    reference, _, model = checkpoint
    ours = tokens(engine(model).generate(prompts, GREEDY))
    for prompt, got in zip(prompts, ours):
        check_top_k_margins(model, prompt + list(got), 4)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
        assert list(got) == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("settings", [dict(long_prefill_token_threshold=7), dict(enable_mixed=False),
                                      dict(num_blocks=18)],
                         ids=["chunk7", "unmixed", "preempting"])
def test_greedy_does_not_depend_on_scheduling(checkpoint, prompts, settings):
    _, _, model = checkpoint
    alone = [tokens(engine(model).generate([p], GREEDY))[0] for p in prompts]
    assert tokens(engine(model, **settings).generate(prompts, GREEDY)) == alone


def test_prefix_caching_keeps_outputs(checkpoint, prompts):
    """Cached blocks carry the indexer keys with the latents: a hit gives the same tokens as a fresh run."""
    _, _, model = checkpoint
    shared = prompts[0] + prompts[1]
    variants = [shared + [5], shared + [6, 7]]
    e = engine(model)
    first = tokens(e.generate(variants, GREEDY))
    assert e.scheduler.allocator.num_cached_blocks > 0
    again = tokens(e.generate(variants, GREEDY))
    fresh = tokens(engine(model, enable_prefix_caching=False).generate(variants, GREEDY))
    assert first == again == fresh


def test_cli_generates_from_a_v32_checkpoint(checkpoint, prompts):
    _, path, model = checkpoint
    prompt = prompts[0][:20]
    want = tokens(engine(model).generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)))[0]
    result = subprocess.run(
        [sys.executable, "-m", "mla_func.cli.commands", "generate", " ".join(map(str, prompt)), "--model", str(path),
         "--max-tokens", "5", "--temperature", "0", "--ignore-eos"],
        capture_output=True, text=True, env={**os.environ}, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert " ".join(map(str, want)) in result.stdout
