"""Bad requests: each answered with OpenAI's error object, its status and the field at fault, while a
good request streams beside them undisturbed; a full queue (429) and a request timeout (504); and a
SIGTERM that lets an open stream finish before the server exits, every block freed."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

import mla_func as mf
from support.server_process import start_server, stopped_cleanly

MAX_NUM_SEQS, MAX_WAITING, TIMEOUT_S = 2, 2, 1.5


@pytest.fixture(scope="module")
def server():
    process = start_server("--model", "demo", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING),
                           "--request-timeout", str(TIMEOUT_S), "--max-model-len", "512")
    yield process
    if process.process.poll() is None:
        stopped_cleanly(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def post(server, path, body):
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.base_url}/{path}", content=raw, headers={"Content-Type": "application/json"},
                      timeout=60)


COMPLETION = {"model": "demo", "prompt": "Return the number of", "max_tokens": 4}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD = [  # (path, body, status, param, words in the message)
    ("completions", b"{not json", 400, None, "not valid JSON"),
    ("completions", b"[1, 2]", 400, None, "JSON object"),
    ("completions", {**COMPLETION, "temprature": 0.5}, 400, "temprature", "unknown field"),
    ("chat/completions", {**CHAT, "foo": 1}, 400, "foo", "unknown field"),
    ("completions", {**COMPLETION, "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ("completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature", "number"),
    ("completions", {**COMPLETION, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {**COMPLETION, "max_tokens": "4"}, 400, "max_tokens", "integer"),
    ("completions", {**COMPLETION, "n": 0}, 400, "n", "greater than or equal to 1"),
    ("completions", {**COMPLETION, "n": 99}, 400, "n", "less than or equal to 16"),
    ("completions", {**COMPLETION, "seed": -1}, 400, "seed", "greater than or equal to 0"),
    ("completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("completions", {**COMPLETION, "presence_penalty": 3}, 400, "presence_penalty", "less than or equal to 2"),
    ("completions", {**COMPLETION, "stop": [""]}, 400, "stop", "non-empty string"),
    ("completions", {**COMPLETION, "stop": ["a"] * 17}, 400, "stop", "at most 16"),
    ("completions", {**COMPLETION, "min_tokens": 9}, 400, "min_tokens", "max_tokens"),
    ("completions", {**COMPLETION, "echo": True}, 400, "echo", "not supported"),
    ("completions", {"model": "demo"}, 400, "prompt", "required"),
    ("completions", {**COMPLETION, "prompt": [1.5]}, 400, "prompt", "token ids"),
    ("completions", {**COMPLETION, "prompt": ""}, 400, "prompt", "empty"),
    ("completions", {**COMPLETION, "prompt": [5000]}, 400, "prompt", "[0, 4096)"),
    ("completions", {**COMPLETION, "prompt": [7] * 600}, 400, "prompt", "maximum length is 512"),
    ("completions", {**COMPLETION, "stop_token_ids": [9999]}, 400, "stop_token_ids", "[0, 4096)"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages",
     "maximum length is 512"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1"),
    ("chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "'user'"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "string"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "'logprobs': true"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     "structured output"),
    ("completions", {**COMPLETION, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("embeddings", {"model": "demo", "input": "x"}, 404, None, "no such path"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_named(server, path, body, status, param, words):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_bad_requests_leave_a_stream_undisturbed(server, client):
    """A greedy stream runs while every bad request above is refused; its text is that of the engine alone."""
    engine = mf.Engine(mf.load_model("demo", device="cpu"), max_num_seqs=2, graphs=False)
    expected = engine.generate(["Create a new"], mf.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    pieces: list[str] = []

    def stream() -> None:
        for chunk in client.completions.create(model="demo", prompt="Create a new", max_tokens=40, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            pieces.append(chunk.choices[0].text)

    thread = threading.Thread(target=stream)
    thread.start()
    for path, body, status, _, _ in BAD:
        assert post(server, path, body).status_code == status
    thread.join(60)
    assert "".join(pieces) == expected.text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt="x", max_tokens=4, temperature=3)
    assert refused.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_full_queue_is_429(server, client):
    # n choices are n requests: more than max_num_seqs + max_waiting at once cannot be taken.
    with pytest.raises(openai.RateLimitError) as full:
        client.completions.create(model="demo", prompt="x", max_tokens=2, n=MAX_NUM_SEQS + MAX_WAITING + 1)
    assert full.value.status_code == 429 and full.value.body["code"] == "queue_full"
    assert len(client.completions.create(model="demo", prompt="x", max_tokens=2,
                                         n=MAX_NUM_SEQS + MAX_WAITING).choices) == MAX_NUM_SEQS + MAX_WAITING


@pytest.fixture(scope="module")
def hurried():
    """A server whose requests time out after 0.3 s: 480 tokens of the demo model (a whole forward each,
    ~1 ms or more a token on any CPU) cannot finish in time, however fast the host."""
    process = start_server("--model", "demo", "--request-timeout", "0.3", "--max-model-len", "512")
    yield process
    if process.process.poll() is None:
        stopped_cleanly(process)


def test_request_timeout_is_504_and_frees_its_blocks(hurried):
    server, client = hurried, openai.OpenAI(base_url=hurried.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as late:
        client.completions.create(model="demo", prompt=[5, 6], max_tokens=480, extra_body={"ignore_eos": True})
    assert late.value.status_code == 504 and late.value.body["code"] == "request_timeout"
    with pytest.raises(openai.APIError, match="request timeout"):
        list(client.completions.create(model="demo", prompt=[5, 6], max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True}))
    metrics = server.metrics()
    assert metrics["mla_func_kv_blocks_in_use"] == 0 and metrics["mla_func_requests_running"] == 0
    assert metrics['mla_func_requests_finished_total{reason="abort"}'] >= 2


def test_sigterm_lets_an_open_stream_finish(server, client):
    """Graceful shutdown: the stream open at SIGTERM completes, then the server exits with nothing left."""
    stream = client.completions.create(model="demo", prompt="Create a new", max_tokens=60, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    server.process.terminate()
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
    stopped_cleanly(server)
