"""`mla-func generate`'s penalty and min_tokens options, run in a subprocess as a user would (its --help in
this process: `support.cli_process.before_the_load`)."""

from __future__ import annotations

import re

import mla_func as mf
from mla_func.serving.engine import Engine
from mla_func.serving.sampling import SamplingParams
from support.cli_process import before_the_load, mla_func


def test_help_shows_the_sampling_options_and_their_defaults(capsys):
    result = before_the_load(capsys, "generate", "--help")
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


def test_n_samples_and_logprobs_print_what_the_engine_returns():
    """--n streams the first sample and prints the others after it; --logprobs / --prompt-logprobs print a
    line per token with the engine's own logprobs (a seeded run, so the engine in this process repeats it)."""
    prompt = "Return the number of"
    result = mla_func("generate", prompt, "--temperature", "0.8", "--seed", "11", "--max-tokens", "5", "--ignore-eos",
                      "--n", "2", "--logprobs", "2", "--prompt-logprobs", "1")
    assert result.returncode == 0, result.stderr
    model = mf.load_model("demo", device="cpu")
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=5, ignore_eos=True, n=2, logprobs=2,
                            prompt_logprobs=1)
    first, second = Engine(model, max_num_seqs=2, max_num_batched_tokens=512).generate([prompt], params)
    blocks = re.split(r"^--- (.*) ---$", result.stdout, flags=re.M)
    text, sections = blocks[0], dict(zip(blocks[1::2], blocks[2::2]))
    assert text.strip("\n") == first.text
    assert sections["sample 2 of 2"].strip("\n") == second.text
    for title, completion, tokens in (("logprobs of sample 1", first, first.token_ids),
                                      ("logprobs of sample 2", second, second.token_ids),
                                      ("prompt logprobs", first, first.prompt_token_ids)):
        lines = sections[title].strip("\n").split("\n")
        entries = completion.logprobs if title.startswith("logprobs") else completion.prompt_logprobs
        assert len(lines) == len(tokens) == len(entries)
        for line, entry in zip(lines, entries):
            shown = re.match(r"""^(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*") (\S+)""", line).group(1)  # after the repr
            assert shown == ("-" if entry is None else f"{entry.logprob:.4f}"), (title, line)
