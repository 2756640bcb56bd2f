"""The engine in a process of its own (what `mla-func serve` runs): the server's process holds the HTTP
side, a spawned child the engine. A child that cannot build the engine is a clear error, not a hang;
the child ends with the server however the server ends (SIGTERM, SIGKILL); a disconnect frees the
request's blocks in the child; a child that dies leaves a server that answers 503; and what crosses
the pipe comes back as it was sent."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from mla_func.models.presets import SHIPPED_PRESETS
from mla_func.server.engine_driver import Admitted, Failure, Load, Pass
from mla_func.server.engine_process import EngineProcess, EngineRecipe, EngineStartError, _decode, _encode
from mla_func.server.metrics import ServerMetrics
from mla_func.serving.requests import Completion, RequestError, StreamEvent, TokenLogprob
from support.cli_process import mla_func
from support.server_process import engine_pid, free_port, gone, start_server, stopped_cleanly, wait_for

DEMO = SHIPPED_PRESETS["demo"]  # the demo's checkpoint folder


@pytest.fixture
def serving():
    """Start servers with `serving(*args)`; any still running at the end is killed (its engine follows)."""
    started = []

    def start(*args: str):
        started.append(start_server(*args))
        return started[-1]

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(30)


def test_sigterm_to_the_server_ends_the_engine_process(serving):
    server = serving("--model", "demo")
    pid = engine_pid(server)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model="demo", prompt="Return the number of", max_tokens=4).choices[0].text
    stopped_cleanly(server)  # SIGTERM: the engine stopped with nothing aborted and no block held
    assert gone(pid, 10)


def test_a_killed_server_takes_its_engine_process_along(serving):
    server = serving("--model", "demo")
    pid = engine_pid(server)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(30)
    assert gone(pid, 30), "the engine process outlived its server"
    assert "the server's process is gone" in server.log.read_text()
    server.log.unlink()


def test_a_disconnect_frees_the_requests_blocks_in_the_engine_process(serving):
    server = serving("--model", "demo", "--max-model-len", "512")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    aborted = 'mla_func_requests_finished_total{reason="abort"}'  # there once a request was aborted
    stream = client.completions.create(model="demo", prompt=[5, 6, 7], max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True})
    next(stream), next(stream)
    held = server.metrics()  # the engine's load as the engine process reported it after its last pass
    assert held["mla_func_kv_blocks_in_use"] > 0 and held["mla_func_requests_running"] == 1
    stream.close()
    assert wait_for(lambda: server.metrics()["mla_func_kv_blocks_in_use"] == 0)
    metrics = server.metrics()
    assert metrics["mla_func_requests_running"] == 0
    assert metrics[aborted] == 1
    stopped_cleanly(server)


def test_a_dead_engine_process_leaves_a_server_that_answers_503(serving):
    server = serving("--model", "demo", "--max-model-len", "512")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="demo", prompt=[5, 6, 7], max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True})
    next(stream)
    os.kill(engine_pid(server), signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine's process has ended"):
        list(stream)  # the open stream ends with an error event rather than hanging
    assert wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="demo", prompt="x", max_tokens=2)
    assert refused.value.status_code == 503
    code, log = server.stop()
    server.log.unlink()
    assert code == -signal.SIGTERM and "exited unexpectedly" in log and "did not stop cleanly" in log, log


def test_engine_thread_serves_from_the_servers_own_process(serving):
    server = serving("--model", "demo", "--engine-thread")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model="demo", prompt="Return the number of", max_tokens=4).choices[0].text
    assert "engine ready in process" not in server.log.read_text()
    stopped_cleanly(server)


def test_a_model_that_fails_to_load_is_an_error_not_a_hang(tmp_path):
    """The folder passes the checks made before the load (its config.json is fine); its weights do not."""
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((DEMO / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes((DEMO / "model.safetensors").read_bytes()[:1000])
    started = time.monotonic()
    result = mla_func("serve", "--model", str(tmp_path), "--device", "cpu", "--port", str(free_port()), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "error: the engine could not be built: CheckpointError:" in result.stderr
    assert "model.safetensors" in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 120


def test_launch_names_what_went_wrong():
    metrics = ServerMetrics()
    with pytest.raises(EngineStartError, match="could not be built: .*no-such-model"):
        EngineProcess.launch(EngineRecipe("no-such-model", warmup=False), metrics, timeout_s=120, say=print)
    with pytest.raises(EngineStartError, match="not ready within 0.01 s"):
        EngineProcess.launch(EngineRecipe("demo"), metrics, timeout_s=0.01, say=print)


@pytest.mark.parametrize("fields, words", [
    (dict(engine_kwargs={"max_num_seq": 4}), "engine_kwargs: .*'max_num_seq'"),
    (dict(device="gpu"), "device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (dict(threads=0), "threads: expected an int >= 1 or None, got 0"),
    (dict(model=""), "model: expected a checkpoint folder or preset name, got ''"),
])
def test_a_bad_recipe_is_refused_by_name(fields, words):
    with pytest.raises(ValueError, match=f"EngineRecipe.{words}"):
        EngineRecipe(**{"model": "demo", **fields})


def test_a_pass_crosses_the_pipe_as_it_was():
    logprob = TokenLogprob(-0.5, {3: -0.5, 9: -1.25})
    completion = Completion(1, (5, 6), (7, 8), "length", text="ab", logprobs=(logprob, logprob), choice=2)
    items = [(0, Admitted((4, 5))), (1, RequestError(2, "the prompt is empty")),
             (0, StreamEvent(1, 8, completion, "b", request_id=4, choice=2, logprob=logprob)),
             (0, StreamEvent(0, 3, request_id=5)), (2, Failure("boom"))]
    done = Pass(items, [(4, 1.5)], [(5, "abort")], 2, Load(1, 2, 3, 4))
    back = _decode(_encode(done))
    assert back.items[1][1].args == items[1][1].args and back.items[1][1].index == 2
    assert back.items[:1] + back.items[2:] == items[:1] + items[2:]
    assert (back.arrived, back.ended, back.tokens, back.load) == (done.arrived, done.ended, done.tokens, done.load)


def test_the_engine_process_refuses_a_bad_request_alone():
    recipe = EngineRecipe("tiny", threads=1, engine_kwargs=dict(num_blocks=64, graphs=False), warmup=False)
    got: list = []
    done = threading.Event()

    def sink(item) -> None:
        got.append(item)
        if isinstance(item, StreamEvent) and item.completion is not None:
            done.set()

    with EngineProcess.launch(recipe, ServerMetrics(), timeout_s=120, say=print) as engine:
        engine.start()
        engine.submit([[1, 2], []], {"max_tokens": 2}, sink)  # the second prompt is empty: neither runs
        engine.submit([[1, 2]], {"max_tokens": 2, "ignore_eos": True}, sink)
        assert done.wait(60)
        report = engine.stop(timeout=60)
    refusal, admitted, *events = got
    assert isinstance(refusal, RequestError) and refusal.index == 1 and "empty" in str(refusal)
    assert isinstance(admitted, Admitted) and [e.request_id for e in events] == list(admitted.request_ids) * 2
    assert events[-1].completion.token_ids == tuple(e.token_id for e in events)
    assert report is not None and (report.aborted, report.blocks_in_use) == (0, 0)
