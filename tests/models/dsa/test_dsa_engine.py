"""The engine and the command line on a DeepSeek-V3.2 checkpoint: greedy tokens are transformers' own,
whatever the scheduling (chunked prefill, mixed steps, prefix caching)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

import mla_func as mf
from support.dsa_reference import check_top_k_margins, make_v32
from support.engine_checks import (GREEDY, assert_greedy_equals_generate, assert_prefix_hits_keep_tokens,
                                    assert_scheduling_keeps_tokens, engine, tokens)
from mla_func.serving.sampling import SamplingParams


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


def test_greedy_equals_transformers_generate(checkpoint, prompts):
    reference, _, model = checkpoint
    assert_greedy_equals_generate(reference, model, prompts, check=lambda ids: check_top_k_margins(model, ids, 4))


@pytest.mark.parametrize("settings", [dict(long_prefill_token_threshold=7), dict(enable_mixed=False),
                                      dict(num_blocks=18)],
                         ids=["chunk7", "unmixed", "preempting"])
def test_greedy_does_not_depend_on_scheduling(checkpoint, prompts, settings):
    assert_scheduling_keeps_tokens(checkpoint[2], prompts, settings)


def test_prefix_caching_keeps_outputs(checkpoint, prompts):
    """Cached blocks carry the indexer keys with the latents: a hit gives the same tokens as a fresh run."""
    shared = prompts[0] + prompts[1]
    assert_prefix_hits_keep_tokens(checkpoint[2], [shared + [5], shared + [6, 7]])


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
