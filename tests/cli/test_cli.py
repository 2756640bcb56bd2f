"""The `mla-func` command line, run as a user would: in a subprocess (and, for further variants of
commands that end before a model loads, `cli.main` in this process: `support.cli_process.before_the_load`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import mla_func as mf
from support.cli_process import ENV, before_the_load, installed_script, mla_func, mla_func_command


def test_console_script_is_installed():
    """`pip install` put the `mla-func` script into the environment's scripts folder (on PATH once it is
    activated); `python -m mla_func.cli` is the same command."""
    script = installed_script()
    assert script is not None
    by_module = subprocess.run([sys.executable, "-m", "mla_func.cli", "--version"], capture_output=True, text=True,
                               env=ENV, timeout=120)
    by_script = subprocess.run([str(script), "--version"], capture_output=True, text=True, env=ENV, timeout=120)
    assert (by_module.returncode, by_module.stderr) == (0, "") and by_module.stdout == by_script.stdout


def test_generate_streams_text_from_the_demo_model_and_summarises():
    result = mla_func("generate", "Return the number of", "--max-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    text = result.stdout.strip()
    assert len(text) > 3 and all(ch.isprintable() or ch == "\n" for ch in text)   # docstrings have paragraphs
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
def test_bad_arguments_give_a_clear_error(args, message, capsys):
    result = before_the_load(capsys, *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_bench_reports_throughput():
    result = mla_func("bench", "--model", "tiny", "--num-prompts", "4", "--min-input-len", "4",
                      "--max-input-len", "12", "--output-len", "4")
    assert result.returncode == 0, result.stderr
    assert re.search(r"4 requests, \d+ prompt \+ 16 output tokens in [\d.]+ s: [\d.]+ output tokens/s", result.stdout)
    latency = re.search(r"time to first token p50/p90/p99 ([\d.]+)/([\d.]+)/([\d.]+) ms, "
                        r"inter-token latency p50/p90/p99 ([\d.]+)/([\d.]+)/([\d.]+) ms", result.stdout)
    assert latency is not None, result.stdout
    ttft, itl = [float(x) for x in latency.groups()[:3]], [float(x) for x in latency.groups()[3:]]
    assert 0 < ttft[0] <= ttft[1] <= ttft[2] and 0 < itl[0] <= itl[1] <= itl[2]
    # tiny caches 3 layers x (32 + 16) latents, float32 on the CPU: 576 bytes a token at the longest request's
    # 12 + 4 tokens (one block of 16).
    cache = re.search(r"cache: 576 bytes a token at 16 tokens; [\d,]+ bytes of blocks hold one sequence of up to "
                      r"(\d+) tokens, or (\d+) of 16", result.stdout)
    assert cache is not None, result.stdout
    assert int(cache.group(1)) >= 16 and int(cache.group(2)) >= 1


# ---- first contact: warnings, user errors, Ctrl-C, --version, stdin, --help ----------------------

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_numpy_is_a_dependency_because_torch_warns_on_every_command_without_it():
    blocked = subprocess.run([sys.executable, "-c", "import sys; sys.modules['numpy'] = None; import torch"],
                             capture_output=True, text=True, env=ENV, timeout=120)
    assert "Failed to initialize NumPy" in blocked.stderr
    assert any(re.match(r"numpy\b", d) for d in pyproject()["project"]["dependencies"])


def test_help_and_version_print_nothing_on_stderr(capsys):
    # A fresh interpreter once: a warning at import time would show on every command's stderr.
    result = mla_func("--help")
    assert result.returncode == 0 and result.stderr == "" and result.stdout.startswith("usage: mla-func")
    for args in (("generate", "--help"), ("bench", "--help"), ("--version",)):
        result = before_the_load(capsys, *args)
        assert result.returncode == 0 and result.stderr == "" and result.stdout, args


def test_generate_prints_no_warning():
    result = mla_func("generate", "If the", "--max-tokens", "4")
    assert result.returncode == 0
    assert "Warning" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("[prompt tokens")


def test_version_is_the_package_version():
    result = mla_func("--version")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"mla-func {pyproject()['project']['version']} (torch ")


def without_triton_interpreter() -> dict:
    return {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}


@pytest.mark.parametrize("args, messages", [
    (("--device", "cuda"), ("--device cuda: CUDA is not available", "available: cpu")),
    (("--device", "tpu:x"), ("--device: expected cpu, cuda or cuda:N, got 'tpu:x'",)),
    (("--backend", "triton"), ("--backend triton: not available on cpu", "available: torch")),
    (("--backend", "aiter"), ("--backend aiter: not available on cpu",)),
    (("--max-tokens", "-5"), ("--max-tokens: SamplingParams.max_tokens must be an int >= 1, got -5",)),
    (("--top-p", "0"), ("--top-p: SamplingParams.top_p must be in (0, 1]",)),
    (("--threads", "0"), ("error: --threads: expected an int >= 1, got 0",)),
])
def test_user_errors_are_one_line_and_come_before_the_model_loads(args, messages, capsys, monkeypatch):
    # The model path does not exist: an error about it would mean the model was loaded first. The first
    # case as a user runs it, the others in this process (with the environment the subprocess gets).
    command = ("generate", "hello", "--model", "/nonexistent/model", *args)
    if args == ("--device", "cuda"):
        result = mla_func(*command, env=without_triton_interpreter())
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        result = before_the_load(capsys, *command)
    assert result.returncode == 2
    for message in messages:
        assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "nonexistent" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_bench_options_are_checked_before_the_model_loads(capsys):
    result = mla_func("bench", "--model", "/nonexistent/model", "--min-input-len", "64", "--max-input-len", "8")
    assert result.returncode == 2 and "--min-input-len 64 is above --max-input-len 8" in result.stderr
    result = before_the_load(capsys, "bench", "--model", "/nonexistent/model", "--num-prompts", "0")
    assert result.returncode == 2 and result.stderr == "error: --num-prompts: expected an int >= 1, got 0\n"


def test_prompt_dash_reads_standard_input():
    args = ("--max-tokens", "8", "--temperature", "0")
    from_stdin = mla_func("generate", "-", *args, stdin="Return the number of\n")
    from_argument = mla_func("generate", "Return the number of", *args)
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert from_stdin.stdout == from_argument.stdout and from_stdin.stdout.strip()
    assert "prompt tokens 5," in from_stdin.stderr and "prompt tokens 5," in from_argument.stderr
    empty = mla_func("generate", "-", *args, stdin="")
    assert empty.returncode == 2 and "standard input" in empty.stderr


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_shows_every_default(command, capsys):
    text = before_the_load(capsys, command, "--help").stdout
    options = text[text.index("options:"):]
    entries = re.split(r"\n  (?=-)", options)[1:]
    flags = [e.split()[0].rstrip(",") for e in entries]
    assert "--model" in flags and ("--max-tokens" in flags or "--num-prompts" in flags)
    for entry in entries:
        if entry.startswith("-h"):
            continue
        assert "default" in entry, entry
    if command == "generate":
        assert re.search(r"--max-tokens MAX_TOKENS\s+.*\(default: 64\)", text)
        assert re.search(r"--temperature TEMPERATURE\s+.*\(default: 0.8\)", text)


def test_ctrl_c_prints_a_summary_and_exits_130():
    command = mla_func_command()
    # A terminal's Ctrl-C reaches a program whose SIGINT has its default action. Tests run in the background
    # (a shell's `&` without job control) inherit SIGINT ignored, and a Python program started so never
    # raises KeyboardInterrupt: the command starts from the default action, as at a terminal.
    start_at_terminal = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                         "os.execv(sys.argv[1], sys.argv[1:])")
    process = subprocess.Popen(
        [sys.executable, "-c", start_at_terminal, *command, "generate", "If the", "--max-tokens", "500",
         "--ignore-eos", "--seed", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
    )
    assert process.stdout is not None
    first = process.stdout.read(1)   # generation has started
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=120)
    stderr = err.decode()
    assert first and process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    summary = re.search(r"generated tokens (\d+), .* finish reason interrupted\]", stderr)
    assert summary is not None, stderr
    assert 1 <= int(summary.group(1)) < 500


def test_streamed_text_is_the_whole_decode_of_the_tokens():
    # Sampled at a high temperature, so that multi-byte characters split over tokens are likely.
    args = ("--max-tokens", "60", "--temperature", "1.5", "--seed", "11", "--ignore-eos")
    result = mla_func("generate", "Create a new", *args)
    assert result.returncode == 0, result.stderr
    model = mf.load_model("demo", device="cpu")
    engine = mf.Engine(model, graphs=False, max_num_seqs=1)
    completion = engine.generate(["Create a new"], mf.SamplingParams(
        temperature=1.5, max_tokens=60, seed=11, ignore_eos=True))[0].raise_for_error()
    assert result.stdout == model.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True) + "\n"


def test_bench_says_what_it_does_and_captures_nothing_on_cpu():
    result = mla_func("bench", "--model", "tiny", "--num-prompts", "4", "--min-input-len", "4",
                      "--max-input-len", "12", "--output-len", "6")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.replace("\r", "\n").splitlines()
    assert lines[0] == "[bench] loading tiny on cpu"
    assert any(line.startswith("[bench] warming up on 4 other random prompts") for line in lines)
    assert any(line.startswith("[bench] measuring 4 requests x 6 output tokens") for line in lines)
    assert "graph" not in result.stderr
    prefill = [line for line in lines if line.startswith("prefill:")]
    decode = [line for line in lines if line.startswith("decode:")]
    assert prefill and decode and "4/4" in prefill[-1] and "24/24" in decode[-1]
    # The prefill bar shows no time-left estimate; the decode bar's first one comes with a rate.
    assert all("<" not in line for line in prefill)


def test_the_cpu_path_runs_without_triton_installed():
    code = (
        "import sys; sys.modules['triton'] = None\n"   # as if not installed: importing it raises ImportError
        "from mla_func.cli.commands import main\n"
        "sys.exit(main(['generate', 'If the', '--max-tokens', '3', '--temperature', '0']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "generated tokens 3" in result.stderr or "finish reason stop" in result.stderr
    assert not any("triton" in d for d in pyproject()["project"]["dependencies"])
    assert any(d.startswith("triton") for d in pyproject()["project"]["optional-dependencies"]["test"])


def test_license_file_matches_the_metadata():
    assert pyproject()["project"]["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")
