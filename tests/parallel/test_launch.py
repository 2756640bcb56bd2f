"""Launching ranks: the README's torchrun example and `mla-func generate --tensor-parallel N` print once,
what one process prints; a rank that fails is named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from mla_func.parallel.workers import free_local_port
from support.cli_process import mla_func

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
EXAMPLE = next(block for block in re.findall(r"^```python\n(.*?)^```$", README, flags=re.MULTILINE | re.DOTALL)
               if "torchrun --nproc-per-node 2" in block)


def test_torchrun_example_prints_what_one_process_prints(tmp_path, capsys):
    script = tmp_path / "generate_tp.py"
    script.write_text(EXAMPLE)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_local_port()), str(script)],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[:6000]
    exec(compile(EXAMPLE, str(script), "exec"), {"__name__": "__main__"})  # one rank, in this process
    alone = capsys.readouterr().out
    assert alone.strip()
    assert result.stdout == alone  # printed once (by rank 0), the same text


def test_cli_tensor_parallel_prints_what_one_process_prints():
    args = ("generate", "The capital of France is", "--max-tokens", "10", "--temperature", "0")
    alone = mla_func(*args)
    split = mla_func(*args, "--tensor-parallel", "2")
    assert alone.returncode == 0 and split.returncode == 0, split.stderr
    assert alone.stdout.strip() and split.stdout == alone.stdout


def test_cli_names_the_rank_that_failed():
    # The demo's 4 heads do not split across 3 ranks: every rank fails, and the command says which first.
    result = mla_func("generate", "The capital", "--max-tokens", "2", "--tensor-parallel", "3")
    assert result.returncode != 0 and result.stdout == ""
    assert "num_attention_heads" in result.stderr and "must be a multiple of 3" in result.stderr
    assert re.search(r"error: rank \d of 3 exited with code 1; the other ranks were stopped", result.stderr)
