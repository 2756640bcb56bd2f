"""Launching ranks: the README's torchrun example (on one host and on two) and `mla-func generate
--tensor-parallel N` (with whole experts a rank, data-parallel attention, or both) print once, what
one process prints; `mla-func bench` runs the same ways; a rank that fails is named; more ranks than
visible GPUs are refused before any starts (on a GPU machine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def _host_launcher(rendezvous: str, node: int, port: str) -> list[str]:
    """Host `node`'s torchrun of a two-host group, one rank a host, meeting at 127.0.0.1:port."""
    if rendezvous == "static":  # host 0 holds the store and global rank 0
        meet = ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port]
    else:  # elastic: the hosts are ranked as they arrive
        meet = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-hosts"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", *meet]


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_hosts_torchrun_launchers_print_what_one_process_prints(tmp_path, capsys, rendezvous):
    """The README's several-hosts launch: one torchrun a host (one rank each, so both ranks are LOCAL_RANK 0
    of their host), meeting at host 0's address; here both hosts are this machine."""
    script = tmp_path / "generate_tp.py"
    script.write_text(EXAMPLE)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    port = str(free_local_port())
    hosts = [subprocess.Popen([*_host_launcher(rendezvous, node, port), str(script)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    try:
        outputs = [host.communicate(timeout=240) for host in hosts]
    finally:
        for host in hosts:
            host.kill()
    for host, (_, stderr) in zip(hosts, outputs):
        assert host.returncode == 0, stderr[:6000]
    exec(compile(EXAMPLE, str(script), "exec"), {"__name__": "__main__"})  # one rank, in this process
    alone = capsys.readouterr().out
    assert alone.strip()
    printed = [stdout for stdout, _ in outputs]
    # Global rank 0 printed it, once: host 0's under the static rendezvous, either host's under c10d.
    assert (printed == [alone, ""]) if rendezvous == "static" else (sorted(printed) == ["", alone])


GENERATE = ("generate", "The capital of France is", "--max-tokens", "10", "--temperature", "0")


@pytest.fixture(scope="module")
def alone():
    result = mla_func(*GENERATE)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    return result.stdout


@pytest.mark.parametrize("cut", [(), ("--expert-parallel",), ("--data-parallel-attention",),
                                 ("--expert-parallel", "--data-parallel-attention")],
                         ids=["tp", "ep", "dp", "dp-ep"])
def test_cli_tensor_parallel_prints_what_one_process_prints(alone, cut):
    split = mla_func(*GENERATE, "--tensor-parallel", "2", *cut)
    assert split.returncode == 0, split.stderr
    assert split.stdout == alone


def test_cli_samples_on_both_ranks_print_what_one_process_prints():
    # Two (greedy) choices: under data-parallel attention one a rank, and rank 0 prints both.
    args = (*GENERATE, "--n", "2")
    alone = mla_func(*args)
    split = mla_func(*args, "--tensor-parallel", "2", "--data-parallel-attention")
    assert alone.returncode == 0 and split.returncode == 0, split.stderr
    assert alone.stdout.strip() and split.stdout == alone.stdout


def test_cli_bench_runs_every_request_under_data_parallel_attention():
    result = mla_func("bench", "--num-prompts", "6", "--min-input-len", "4", "--max-input-len", "12", "--output-len",
                      "4", "--tensor-parallel", "2", "--data-parallel-attention", "--expert-parallel")
    assert result.returncode == 0, result.stderr
    assert re.match(r"6 requests, \d+ prompt \+ 24 output tokens in ", result.stdout), result.stdout


@pytest.mark.parametrize("cut", ["--expert-parallel", "--data-parallel-attention"])
def test_cli_refuses_a_cut_without_ranks(cut):
    result = mla_func("generate", "The capital", "--max-tokens", "2", cut)
    assert result.returncode == 2 and result.stdout == ""
    assert f"{cut} needs --tensor-parallel N >= 2" in result.stderr and "got --tensor-parallel 1" in result.stderr


def test_cli_names_the_rank_that_failed():
    # The demo's 4 heads do not split across 3 ranks: every rank fails, and the command says which first.
    result = mla_func("generate", "The capital", "--max-tokens", "2", "--tensor-parallel", "3")
    assert result.returncode != 0 and result.stdout == ""
    assert "num_attention_heads" in result.stderr and "must be a multiple of 3" in result.stderr
    assert re.search(r"error: rank \d of 3 exited with code 1; the other ranks were stopped", result.stderr)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("command", [("generate", "The capital", "--max-tokens", "2"), ("bench", "--num-prompts", "2"),
                                     ("serve",)], ids=["generate", "bench", "serve"])
def test_cli_refuses_more_ranks_than_gpus_before_starting_any(command):
    ranks = torch.cuda.device_count() + 1
    result = mla_func(*command, "--device", "cuda", "--tensor-parallel", str(ranks), env={**os.environ}, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert f"--tensor-parallel {ranks}: one GPU a rank, and {ranks - 1} CUDA device" in result.stderr, result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_refuses_one_named_gpu_for_several_ranks():
    result = mla_func("generate", "The capital", "--max-tokens", "2", "--device", "cuda:0", "--tensor-parallel", "2",
                      env={**os.environ}, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert "--device cuda:0 with --tensor-parallel 2: rank r takes GPU r" in result.stderr, result.stderr
