"""bench/layer.py on the CPU over gloo, as its smoke test: V4's layer in its released layout (FP8 linears, FP4
routed experts drawn by `ranks.random_shard`, every cache group given its table by `step_parallel.decode_plan`),
on one rank and two ranks with data-parallel attention and whole experts, writes a row of each, at a
context within the window's lookback and one past it (group 0 then holds only the blocks within it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_v4_layer_bench_runs_on_two_gloo_ranks(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "layer.py"), "--device", "cpu", "--shape", "v4-tiny", "--fp8",
         "--tensor-parallel", "2", "--modes", "dp-ep", "--batches", "2", "--contexts", "64", "200", "--iters", "1",
         "--commit", "0" * 40, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    written, = (tmp_path / "layer-fp8-v4-tiny" / "cpu").glob("*.json")
    bench = json.loads(written.read_text())
    assert bench["weight_format"] == "fp8 16x16 blocks, fp4 routed experts"
    # 200 tokens reach past the window's lookback: group 0's first blocks are the scratch block there
    rows = {(row["mode"], row["context"]): row for row in bench["rows"]}
    assert set(rows) == {(mode, context) for mode in ("1 rank", "DP-attention 2 + EP") for context in (64, 200)}
    assert all(row["rank_batch"] == 1 for (mode, _), row in rows.items() if mode != "1 rank")
    assert all(row["graph_ms"] > 0 for row in rows.values())
