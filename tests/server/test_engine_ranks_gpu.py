"""`mla-func serve --tensor-parallel 2` on two GPUs of one host: NCCL ranks for the model, the gloo group
beside them for each round's commands.

In float32 the sharded server's greedy answers (`greedy_answers`: completions plain, streamed and added
together, a chat's reply) equal one GPU's server's, tensor-parallel and with data-parallel attention over
whole experts; in bf16, with the Triton backend and graphs on (the defaults), both ways answer every
request and stop with nothing aborted and no block held.
"""

from __future__ import annotations

import pytest
import torch

from support.server_process import children, engine_pid, gone, greedy_answers, start_server, stopped_cleanly

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

CUTS = [(), ("--data-parallel-attention", "--expert-parallel")]
START_S = 900  # a cold Triton cache compiles the kernels and captures the graphs on every rank


@pytest.fixture(scope="module")
def one_gpu():
    server = start_server("--model", "demo", "--dtype", "float32", device="cuda", timeout=START_S)
    try:
        yield greedy_answers(server)
    finally:
        stopped_cleanly(server)


def _served(*args: str) -> dict:
    server = start_server("--model", "demo", "--tensor-parallel", "2", *args, device="cuda", timeout=START_S)
    try:
        rank_0 = engine_pid(server)
        others = children(rank_0)
        answers = greedy_answers(server)
    except BaseException:
        server.process.kill()
        raise
    stopped_cleanly(server)
    assert gone(rank_0, 60) and all(gone(pid, 60) for pid in others), "a rank outlived the server"
    return answers


@pytest.mark.parametrize("cut", CUTS, ids=["tp", "dp-ep"])
def test_float32_answers_on_two_gpus_equal_one_gpus(one_gpu, cut):
    assert _served("--dtype", "float32", *cut) == one_gpu


@pytest.mark.parametrize("cut", CUTS, ids=["tp", "dp-ep"])
def test_bf16_with_graphs_answers_every_request(cut):
    answers = _served(*cut)
    assert all(answers["plain"]) and answers["streamed"] and answers["chat"] and all(answers["together"])
