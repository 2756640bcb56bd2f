"""The `mla-func` command line, run as a user would: in a subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, as on a fresh machine


def mla_func(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    exe = shutil.which("mla-func")
    command = [exe] if exe else [sys.executable, "-m", "mla_func.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_console_script_is_installed():
    assert shutil.which("mla-func") is not None


def test_generate_streams_text_from_the_demo_model_and_summarises():
    result = mla_func("generate", "Return the number of", "--max-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    text = result.stdout.strip()
    assert len(text) > 3 and text.isprintable()
    summary = re.search(
        r"prompt tokens (\d+), generated tokens (\d+), time to first token (\d+) ms, ([\d.]+|nan) tokens/s", result.stderr
    )
    assert summary is not None, result.stderr
    assert int(summary.group(1)) > 0 and 1 <= int(summary.group(2)) <= 12


def test_generate_is_reproducible_with_a_seed():
    args = ("generate", "This module provides", "--max-tokens", "10", "--temperature", "0.9", "--seed", "3")
    first, second = mla_func(*args), mla_func(*args)
    assert first.returncode == 0 and first.stdout == second.stdout


def test_generate_with_token_ids_on_a_model_without_tokenizer():
    result = mla_func("generate", "1 2 3", "--model", "tiny", "--max-tokens", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 4


@pytest.mark.parametrize("args, message", [
    (("generate", "hello", "--temperature", "-1"), "temperature"),
    (("generate", "hello", "--model", "/nonexistent/model"), "neither a checkpoint folder nor a preset"),
])
def test_bad_arguments_give_a_clear_error(args, message):
    result = mla_func(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_bench_reports_throughput():
    result = mla_func("bench", "--model", "tiny", "--num-prompts", "4", "--min-input-len", "4",
                      "--max-input-len", "12", "--output-len", "4")
    assert result.returncode == 0, result.stderr
    assert re.search(r"4 requests, \d+ prompt \+ 16 output tokens in [\d.]+ s: [\d.]+ output tokens/s", result.stdout)
