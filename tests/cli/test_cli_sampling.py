"""`mla-func generate`'s penalty and min_tokens options, run in a subprocess as a user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import mla_func as mf
from mla_func.serving.engine import Engine
from mla_func.serving.sampling import SamplingParams

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def mla_func(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_func.cli.commands", *args], capture_output=True, text=True,
                          timeout=240, env=ENV)


def test_help_shows_the_sampling_options_and_their_defaults():
    result = mla_func("generate", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for option, default in [("--repetition-penalty", "1.0"), ("--presence-penalty", "0.0"),
                            ("--frequency-penalty", "0.0"), ("--min-tokens", "0")]:
        assert re.search(rf"{option} \S+ (?:(?!--).)*\(default: {re.escape(default)}\b", text), (option, text)


def test_generate_applies_the_penalties_and_min_tokens():
    prompt = "Return the number of"
    result = mla_func("generate", prompt, "--temperature", "0", "--max-tokens", "16", "--min-tokens", "16",
                      "--repetition-penalty", "1.6", "--presence-penalty", "0.3", "--frequency-penalty", "0.4")
    assert result.returncode == 0, result.stderr
    assert re.search(r"generated tokens 16\b.*finish reason length", result.stderr), result.stderr

    model = mf.load_model("demo", device="cpu")
    greedy = dict(temperature=0.0, max_tokens=16, min_tokens=16)
    penalised = SamplingParams(**greedy, repetition_penalty=1.6, presence_penalty=0.3, frequency_penalty=0.4)
    want = Engine(model, max_num_seqs=1, max_num_batched_tokens=512).generate([prompt], penalised)[0]
    plain = Engine(model, max_num_seqs=1, max_num_batched_tokens=512).generate([prompt], SamplingParams(**greedy))[0]
    assert want.text != plain.text  # the options change the output...
    assert result.stdout.rstrip("\n") == want.text  # ...exactly as the engine does


def test_a_bad_penalty_is_one_line_naming_the_field():
    result = mla_func("generate", "x", "--repetition-penalty", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "error: --repetition-penalty: SamplingParams.repetition_penalty must be a number in [1e-6, 1e6] (1 = off), got 0.0" \
        in result.stderr
