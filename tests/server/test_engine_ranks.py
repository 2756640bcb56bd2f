"""`mla-func serve --tensor-parallel N`: the engine's process is rank 0 of N and starts the others.

Over gloo on the CPU, as a user runs it (a subprocess, a real OpenAI client): the sharded server's
greedy completions (plain, streamed, and two prompts added together, which data-parallel attention
gives to the two ranks in turn) and a chat's reply equal one process's server's, tensor-parallel and
with data-parallel attention over whole experts; a request after the engine sat idle past
`HEARTBEAT_S` (the empty rounds that keep the other ranks inside the group's timeout) is answered
too; SIGTERM stops every rank with nothing aborted and no block held. A rank that cannot build its
engine is named and the command fails; a rank that dies while serving leaves a server that answers 503.
One that ends before the ranks' group forms is named at once (the watch, over real processes).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess

import httpx
import openai
import pytest

from mla_func.server.engine_process import EngineRecipe
from mla_func.server.engine_ranks import HEARTBEAT_S, watch_rendezvous
from support.cli_process import mla_func
from support.server_process import (PROMPTS, children, engine_pid, free_port, gone, greedy_answers, start_server,
                                   stopped_cleanly, wait_for)


@pytest.fixture(scope="module")
def one_process():
    server = start_server("--model", "demo")
    try:
        yield greedy_answers(server)
    finally:
        stopped_cleanly(server)


@pytest.mark.parametrize("cut", [(), ("--data-parallel-attention", "--expert-parallel")], ids=["tp", "dp-ep"])
def test_a_sharded_server_answers_what_one_process_answers(one_process, cut):
    server = start_server("--model", "demo", "--tensor-parallel", "2", *cut)
    try:
        rank_0 = engine_pid(server)
        others = children(rank_0)
        assert len(others) >= 1, "rank 0 started no rank"
        assert greedy_answers(server) == one_process
        time.sleep(HEARTBEAT_S + 1)  # idle: rank 0 sends the others empty rounds
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        again = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert again.choices[0].text == one_process["plain"][0]
    except BaseException:
        server.process.kill()
        raise
    stopped_cleanly(server)
    assert gone(rank_0, 30) and all(gone(pid, 30) for pid in others), "a rank outlived the server"


def test_a_rank_that_cannot_build_is_named():
    # The demo's 4 heads do not split across 3 ranks: every rank says so, and the command fails.
    started = time.monotonic()
    result = mla_func("serve", "--model", "demo", "--device", "cpu", "--port", str(free_port()),
                      "--tensor-parallel", "3", timeout=180)
    assert result.returncode == 2, result.stderr
    assert "error: the engine could not be built: ConfigError:" in result.stderr
    assert "must be a multiple of 3" in result.stderr
    assert "[engine rank 1] error: ConfigError:" in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 180


def test_a_dead_rank_leaves_a_server_that_answers_503():
    server = start_server("--model", "demo", "--tensor-parallel", "2")
    try:
        others = children(engine_pid(server))
        for pid in others:
            os.kill(pid, signal.SIGKILL)
        # Rank 0's next round (within HEARTBEAT_S) meets the closed connection, and its process ends.
        assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, within=HEARTBEAT_S + 60)
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="demo", prompt="x", max_tokens=2)
        assert refused.value.status_code == 503
    finally:
        code, log = server.stop()
        server.log.unlink()
    assert "exited unexpectedly" in log, log


def test_engine_thread_and_ranks_are_refused_together():
    result = mla_func("serve", "--model", "demo", "--engine-thread", "--tensor-parallel", "2")
    assert result.returncode == 2 and "--engine-thread: the engine of --tensor-parallel 2 runs in 2" in result.stderr


@pytest.mark.parametrize("fields, words", [
    (dict(tensor_parallel=0), "tensor_parallel: expected an int >= 1, got 0"),
    (dict(data_parallel_attention=True), "they need tensor_parallel >= 2, got 1"),
])
def test_a_bad_rank_recipe_is_refused_by_name(fields, words):
    with pytest.raises(ValueError, match=f"EngineRecipe.*{words}"):
        EngineRecipe(**{"model": "demo", **fields})


def _started(*targets: tuple) -> tuple[BaseProcess, ...]:
    context = multiprocessing.get_context("spawn")
    processes = tuple(context.Process(target=target, args=args, daemon=True) for target, *args in targets)
    for process in processes:
        process.start()
    return processes


def _stopped(processes: tuple[BaseProcess, ...]) -> None:
    for process in processes:
        process.kill()
        process.join()


@pytest.mark.parametrize("ends", ["exits", "killed"])
def test_a_rank_that_ends_before_the_group_forms_is_named_at_once(ends):
    # Rank 0 waits inside the rendezvous; without the watch it would wait out the group's timeout (300 s).
    others = _started((time.sleep, 120), (time.sleep, 120) if ends == "killed" else (os._exit, 3))
    if ends == "killed":
        os.kill(others[1].pid, signal.SIGKILL)
    told: list[str] = []
    start = time.monotonic()
    try:
        watch_rendezvous(others, threading.Event(), told.append)
    finally:
        _stopped(others)
    how = "was killed by signal 9" if ends == "killed" else "exited with code 3"
    assert told == [f"rank 2 of 3 {how} before the ranks' group formed (its error is above)"]
    assert time.monotonic() - start < 30


def test_the_rendezvous_watch_ends_quietly_once_the_group_forms():
    others = _started((time.sleep, 120))
    formed = threading.Event()
    threading.Timer(0.3, formed.set).start()
    told: list[str] = []
    try:
        watch_rendezvous(others, formed, told.append)
        assert formed.is_set() and others[0].is_alive()
    finally:
        _stopped(others)
    assert told == []
