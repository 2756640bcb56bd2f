"""bench/soak.py runs end to end on CPU (a handful of requests) and reports zero failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_a_short_soak_finds_nothing_and_writes_its_counts(tmp_path):
    args = ["--model", "tiny", "--requests", "48", "--round-size", "12", "--max-num-seqs", "6",
            "--max-num-batched-tokens", "64", "--max-prompt-len", "24", "--max-output-len", "8",
            "--bad-fraction", "0.3", "--seed", "1", "--out", str(tmp_path)]
    result = subprocess.run([sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("soak/cpu/*.json")   # bench/common.py's <bench>/<device>/<date>-<commit>.json
    report = json.loads(path.read_text())
    counts = report["counts"]
    assert report["failures"] == 0 and report["unexpected"] == []
    assert counts["requests"] == 48 and counts["leaked blocks"] == 0 and counts["non-finite logits rows"] == 0
    errors = sum(v for k, v in counts.items() if k.startswith("error: ") and k != "error: bad score")
    completed = sum(v for k, v in counts.items() if k.startswith("completed"))
    assert errors > 0 and completed > 0
    assert completed + errors + counts.get("requests abandoned", 0) == 48
    assert "leaked blocks" in result.stdout and report["commit"]
