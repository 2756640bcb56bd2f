"""`mla-func generate --speculative-tokens k`: the same tokens, and the acceptance rate in the summary line."""

from __future__ import annotations

import re

from support.mtp_checkpoints import mtp_checkpoint
from support.mla_reference import make_reference
from support.cli_process import before_the_load, mla_func


def test_generate_with_drafts_gives_the_same_tokens_and_reports_acceptance(tmp_path):
    _, path = mtp_checkpoint(tmp_path / "v3", seed=31, vocab_size=8, echo=True)
    common = ("generate", "1 2 3 4", "--model", str(path), "--max-tokens", "12", "--temperature", "0",
              "--ignore-eos")
    plain = mla_func(*common)
    drafted = mla_func(*common, "--speculative-tokens", "2")
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert drafted.stdout == plain.stdout and len(plain.stdout.split()) == 12
    rate = re.search(r"acceptance rate (\d+)% \((\d+) of (\d+) drafts\), finish reason length\]", drafted.stderr)
    assert rate is not None, drafted.stderr
    assert int(rate.group(3)) > 0 and round(100 * int(rate.group(2)) / int(rate.group(3))) == int(rate.group(1))
    assert "acceptance rate" not in plain.stderr


def test_drafts_need_an_mtp_layer_or_a_valid_count(tmp_path, capsys):
    # Refused before the load: in this process (tests/cli/test_cli_errors.py runs both kinds in a subprocess).
    make_reference("v3-qlora-noaux", seed=5).save_pretrained(tmp_path / "plain")   # no MTP layer
    result = before_the_load(capsys, "generate", "1 2 3", "--model", str(tmp_path / "plain"), "--speculative-tokens", "2")
    assert result.returncode == 2 and re.fullmatch(
        r"error: --speculative-tokens 2 needs a checkpoint with a multi-token-prediction \(MTP\) layer, and "
        r"\S+ has none \(no model\.layers\.\d+\.\* tensors\); run it without --speculative-tokens\n",
        result.stderr), result.stderr
    result = before_the_load(capsys, "generate", "Return", "--speculative-tokens", "9")
    assert result.returncode == 2 and "--speculative-tokens: expected an int in [0, 8], got 9" in result.stderr
