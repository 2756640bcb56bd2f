"""`mla-func`'s user errors and notes, run in a subprocess as a user would: each error is one
`error:` line (no usage block) naming the option, with exit status 2, and comes before the load.

Each kind of mistake runs in a subprocess at least once; its further variants, which argparse
or the checks after it refuse before any model loads, call `cli.main` in the test's own process
(`support.cli_process.before_the_load`: the same output, without a few seconds of interpreter start each)."""

from __future__ import annotations

import math
import os
import re
import resource
import subprocess
from functools import partial
from pathlib import Path

import pytest
import transformers

from mla_func.models.presets import v32_lite
from mla_func.models.tensor_shapes import hf_tensor_shapes
from support.cli_process import before_the_load, mla_func_command

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, as on a fresh machine
MISSING = "/nonexistent/model"  # a model that would fail to load: an error about it means the load came first


def mla_func(*args: str, timeout: int = 240, limit_memory: int | None = None) -> subprocess.CompletedProcess:
    """`mla-func ARGS` in a subprocess; `limit_memory` caps its address space (bytes)."""
    command = mla_func_command()

    def cap() -> None:
        if limit_memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_memory, limit_memory))

    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=ENV, input="",
                          preexec_fn=cap)


def assert_one_error(result: subprocess.CompletedProcess, expected: str) -> None:
    assert (result.returncode, result.stderr) == (2, f"error: {expected}\n"), result.stderr
    assert result.stdout == ""


# ---- option values and unknown options: argparse's errors, one line each -----------------------------

@pytest.mark.parametrize("args, expected", [
    (("generate", "x", "--speculative-tokens", "9"), "--speculative-tokens: expected an int in [0, 8], got 9"),
    (("generate", "x", "--threads", "0"), "--threads: expected an int >= 1, got 0"),
    (("generate", "x", "--threads=0"), "--threads: expected an int >= 1, got 0"),
    (("generate", "x", "--max-tokens", "many"), "--max-tokens: invalid int value: 'many'"),
    (("generate", "x", "--max-tokens"), "--max-tokens: expected one argument"),
    (("bench", "--num-prompts", "0"), "--num-prompts: expected an int >= 1, got 0"),
    (("bench", "--speculative-tokens", "-1"), "--speculative-tokens: expected an int in [0, 8], got -1"),
])
def test_a_bad_option_value_is_one_line_naming_the_option_and_its_range(args, expected, capsys):
    # The report's own cases as a user runs them; the other variants in this process.
    run = mla_func if args[2:3] in (("--speculative-tokens",), ("--threads",)) else partial(before_the_load, capsys)
    assert_one_error(run(*args, "--model", MISSING), expected)


def test_a_bad_choice_lists_the_choices_on_one_line(capsys):
    result = before_the_load(capsys, "generate", "x", "--model", MISSING, "--dtype", "f16")
    assert result.returncode == 2
    assert re.fullmatch(r"error: --dtype: invalid choice: 'f16' \(choose from '?bfloat16'?, '?float16'?, '?float32'?\)\n",
                        result.stderr), result.stderr


@pytest.mark.parametrize("args, expected", [
    (("generate", "x", "--temprature", "0"), "unknown option --temprature: did you mean --temperature?"),
    (("generate", "x", "--temprature=0"), "unknown option --temprature: did you mean --temperature?"),
    (("generate", "x", "--top_k", "3"), "unknown option --top_k: did you mean --top-k, --stop or --top-p?"),
    (("generate", "x", "--seeds", "3"), "unknown option --seeds: did you mean --seed?"),
    (("bench", "--num-promts", "3"), "unknown option --num-promts: did you mean --num-prompts?"),
    (("generate", "x", "--frobnicate"), "unknown option --frobnicate; see mla-func generate --help"),
    (("generate", "x", "--temprature", "0", "--modle", "tiny"),
     "unknown option --temprature: did you mean --temperature?; unknown option --modle: did you mean --model?"),
    (("generate", "two", "words"), "unexpected argument 'words'; see mla-func generate --help"),
    (("generate",), "one of the arguments prompt --chat is required; see mla-func generate --help"),
])
def test_an_unknown_option_suggests_the_closest_ones_of_its_command(args, expected, capsys):
    # The misspelling from the report as a user runs it; the other variants in this process.
    run = mla_func if args == ("generate", "x", "--temprature", "0") else partial(before_the_load, capsys)
    assert_one_error(run(*args), expected)


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_still_prints_the_usage(command, capsys):
    result = before_the_load(capsys, command, "--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith(f"usage: mla-func {command} ") and "--speculative-tokens" in result.stdout


# ---- drafts on a model without a multi-token-prediction layer ----------------------------------------

def test_drafts_on_a_v4_model_use_its_random_mtp_layer():
    result = mla_func("generate", "1 2 3", "--model", "v4-tiny", "--speculative-tokens", "2", "--max-tokens", "4",
                      "--temperature", "0", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 4 and "acceptance rate" in result.stderr


def test_batch_invariance_on_a_v4_model_runs():
    result = mla_func("generate", "1 2 3", "--model", "v4-tiny", "--batch-invariant", "--max-tokens", "4",
                      "--temperature", "0", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 4


def test_an_unknown_cache_dtype_names_the_flag(capsys):
    bad = before_the_load(capsys, "bench", "--model", MISSING, "--kv-cache-dtype", "fp16")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --kv-cache-dtype: invalid choice: 'fp16'")


@pytest.mark.parametrize("model", ["tiny", "v4-tiny"])
def test_fp8_cache_generates(model):
    result = mla_func("generate", "1 2 3", "--model", model, "--kv-cache-dtype", "fp8", "--max-tokens", "4",
                      "--temperature", "0", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 4


def test_batch_invariant_drafts_run():
    result = mla_func("generate", "1 2 3", "--model", "tiny", "--batch-invariant", "--speculative-tokens", "2",
                      "--max-tokens", "6", "--temperature", "0", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 6 and "acceptance" in result.stderr


def tiny_deepseek_v3(folder: Path, **save: str) -> Path:
    """README's tiny transformers DeepSeek-V3 checkpoint: config.json says num_nextn_predict_layers 1,
    but save_pretrained writes no MTP layer."""
    config = transformers.DeepseekV3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(folder, **save)
    return folder


@pytest.mark.parametrize("save", [{}, {"max_shard_size": "200KB"}], ids=["one file", "sharded with an index"])
def test_drafts_on_a_checkpoint_without_an_mtp_layer_name_the_flag(tmp_path, save, capsys):
    folder = tiny_deepseek_v3(tmp_path / "tiny-deepseek-v3", **save)
    assert (folder / "model.safetensors.index.json").exists() == bool(save)
    # generate as a user runs it, bench in this process.
    for run, command in ((mla_func, ("generate", "1 2 3")), (partial(before_the_load, capsys), ("bench",))):
        result = run(*command, "--model", str(folder), "--speculative-tokens", "1")
        assert_one_error(result, f"--speculative-tokens 1 needs a checkpoint with a multi-token-prediction (MTP) "
                                 f"layer, and {folder} has none (no model.layers.2.* tensors); run it without "
                                 "--speculative-tokens")
    plain = mla_func("generate", "1 2 3", "--model", str(folder), "--max-tokens", "2", "--temperature", "0")
    assert plain.returncode == 0, plain.stderr


def test_w8a8_needs_fp8_weights_and_runs_an_fp8_checkpoint(tmp_path, capsys):
    # The first refusal as a user runs it, the others in this process.
    assert_one_error(mla_func("generate", "1 2", "--model", "tiny", "--w8a8"),
                     "--w8a8: tiny is a shape preset, whose random weights are not FP8; give an FP8 checkpoint "
                     "folder (`mla-func quantize SRC DST` writes one), or run it without --w8a8")
    folder = tiny_deepseek_v3(tmp_path / "bf16")
    assert_one_error(before_the_load(capsys, "bench", "--model", str(folder), "--w8a8"),
                     f"--w8a8: {folder} has no FP8 weights (its config.json has no quantization_config); "
                     "`mla-func quantize SRC DST` writes an FP8 copy, or run it without --w8a8")
    fp8 = tmp_path / "fp8"
    assert mla_func("quantize", str(folder), str(fp8)).returncode == 0
    assert_one_error(before_the_load(capsys, "generate", "1 2", "--model", str(fp8), "--w8a8", "--batch-invariant"),
                     "--w8a8 with --batch-invariant: the batch-invariant steps multiply FP8 weights by 16-bit "
                     "activations; run without one of them")
    # --ignore-eos: the random (unseeded) weights may draw the end-of-sequence token among the three.
    result = mla_func("generate", "1 2 3", "--model", str(fp8), "--w8a8", "--max-tokens", "3", "--temperature", "0",
                      "--threads", "1", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 3


def test_drafts_on_a_shape_preset_use_its_random_mtp_layer():
    result = mla_func("generate", "1 2 3", "--model", "tiny", "--speculative-tokens", "1", "--max-tokens", "3",
                      "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "acceptance rate" in result.stderr


# ---- lengths: refused before the load (bench), cut with a note (generate) ----------------------------

def test_bench_prompts_longer_than_the_model_are_refused_before_the_load():
    result = mla_func("bench", "--min-input-len", "500", "--max-input-len", "600")
    assert_one_error(result, "--max-input-len 600 + --output-len 32 = 632 tokens, over the model's maximum length "
                             "512 (demo's max_position_embeddings)")


def test_max_tokens_past_the_model_length_is_cut_with_a_note():
    prompt = " ".join(["Return the number of items."] * 83)   # 499 of the demo's tokens: 13 fit after it
    result = mla_func("generate", prompt, "--max-tokens", "5000", "--temperature", "0", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    note, summary = result.stderr.splitlines()
    assert note == ("note: --max-tokens 5000 cut to 13: the model's maximum length is 512 and the prompt has "
                    "499 tokens")
    assert summary.startswith("[prompt tokens 499, generated tokens 13,") and "finish reason length]" in summary


# ---- the seed: fresh each run unless given, shown in the summary line ------------------------------

SAMPLED = ("generate", "1 2 3", "--model", "tiny", "--max-tokens", "24", "--temperature", "1", "--ignore-eos",
           "--threads", "1")


def summary_seed(result: subprocess.CompletedProcess) -> int:
    assert result.returncode == 0, result.stderr
    found = re.search(r", seed (\d+), finish reason length\]$", result.stderr.strip())
    assert found is not None, result.stderr
    return int(found.group(1))


def test_runs_without_a_seed_differ_and_the_summary_seed_repeats_one():
    # tiny's random weights spread probability over its 512 tokens: 24 equal draws by chance are negligible.
    first, second = mla_func(*SAMPLED), mla_func(*SAMPLED)
    assert summary_seed(first) != summary_seed(second)
    assert first.stdout != second.stdout
    again = mla_func(*SAMPLED, "--seed", str(summary_seed(first)))
    assert summary_seed(again) == summary_seed(first) and again.stdout == first.stdout


def test_runs_with_the_same_seed_are_equal():
    first, second = mla_func(*SAMPLED, "--seed", "12345"), mla_func(*SAMPLED, "--seed", "12345")
    assert summary_seed(first) == summary_seed(second) == 12345
    assert first.stdout == second.stdout and len(first.stdout.split()) == 24


def test_a_greedy_run_shows_no_seed():
    result = mla_func("generate", "1 2 3", "--model", "tiny", "--max-tokens", "3", "--temperature", "0")
    assert result.returncode == 0 and "seed" not in result.stderr, result.stderr


# ---- a model too big for this machine --------------------------------------------------------------

V32_LITE_BYTES = 4 * sum(math.prod(shape) for shape in hf_tensor_shapes(v32_lite()).values())  # float32 on CPU
PHYSICAL_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.skipif(PHYSICAL_MEMORY >= V32_LITE_BYTES, reason="this machine has the memory for v32-lite")
def test_a_model_too_big_for_this_machine_is_refused_up_front():
    # The cap keeps a load that does not refuse from taking the machine's memory: it then fails at
    # an allocation instead, with a traceback that fails this test.
    result = mla_func("generate", "1 2", "--model", "v32-lite", timeout=120, limit_memory=8 << 30)
    assert result.returncode == 2, result.stderr[-2000:]
    assert re.fullmatch(r"error: [^\n]*\d[^\n]*\n", result.stderr), result.stderr[-2000:]
