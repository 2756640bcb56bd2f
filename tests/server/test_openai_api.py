"""The server through the real `openai` client: completions and chat, whole and streamed, n > 1, stop
strings cut across token boundaries, seeded reproducibility, and logprobs equal to the log-softmax of
`Engine.score`'s logits. Expected values come from an engine in this process over the same model."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch

import mla_func as mf
from support.server_process import start_server, stopped_cleanly
from support.stop_strings import spanning_stop

PROMPTS = ["Return the number of", "Create a new", "This module provides"]
CHAT = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "add two numbers"}]


@pytest.fixture(scope="module")
def server():
    process = start_server("--model", "demo", "--max-num-seqs", "8")
    yield process
    stopped_cleanly(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine():
    return mf.Engine(mf.load_model("demo", device="cpu"), max_num_seqs=8, graphs=False)


def greedy(max_tokens, **kwargs):
    return mf.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "mla_func_kv_blocks_in_use" in server.metrics()
    assert "engine ready in process" in server.log.read_text()  # the engine runs in a process of its own


def test_completion_whole_and_streamed(client, engine):
    expected = engine.generate(PROMPTS, greedy(10))
    got = client.completions.create(model="demo", prompt=PROMPTS, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [c.text for c in expected]
    assert {c.finish_reason for c in got.choices} == {"length"}
    assert got.usage.completion_tokens == 30
    assert got.usage.prompt_tokens == sum(len(c.prompt_token_ids) for c in expected)
    pieces, reasons = [], []
    for chunk in client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == expected[0].text and reasons[-1] == "length" and len(pieces) > 1


def test_chat_whole_and_streamed(client, engine):
    expected = engine.generate([CHAT], greedy(8))[0]
    got = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_n_choices_seeded_and_reproducible(client, engine):
    params = dict(model="demo", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=1234, n=3)
    first = client.completions.create(**params)
    second = client.completions.create(**params)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice samples with a seed of its own
    # The first choice is the request's own seed: the same as a request with n = 1.
    alone = engine.generate([PROMPTS[1]], mf.SamplingParams(temperature=1.0, max_tokens=8, seed=1234))[0]
    assert first.choices[0].text == alone.text
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**params, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in first.choices]
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, seed=7, n=2)
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_strings_cut_across_token_boundaries(client, engine):
    rng = random.Random(42)
    for prompt in PROMPTS:
        full = engine.generate([prompt], greedy(24))[0]
        stop, before, _ = spanning_stop(engine.model, full.token_ids, rng)
        got = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0,
                                        stop=["\x00never", stop], extra_body={"ignore_eos": True})
        assert (got.choices[0].text, got.choices[0].finish_reason) == (before, "stop")
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="demo", prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True,
            extra_body={"ignore_eos": True}))
        assert streamed == before


def test_stop_token_ids(client, engine):
    full = engine.generate([PROMPTS[0]], greedy(12))[0]
    stop_id = full.token_ids[4]
    cut = full.token_ids[: full.token_ids.index(stop_id) + 1]
    got = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == engine.model.tokenizer.decode(list(cut))


def reference_logprobs(engine, prompt_ids, token_ids):
    """[n, V] float32 log-softmax of the logits that predicted each token, from `Engine.score`."""
    ids = list(prompt_ids) + list(token_ids)
    return torch.log_softmax(engine.score(ids[:-1])[len(prompt_ids) - 1:].float(), dim=-1)


def token_id(name):
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completion_logprobs_equal_log_softmax_of_score(client, engine, temperature):
    prompt_ids = list(engine.model.tokenizer.encode(PROMPTS[2]).ids)
    got = client.completions.create(model="demo", prompt=prompt_ids, max_tokens=8, temperature=temperature, seed=5,
                                    logprobs=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = got.choices[0].logprobs
    ids = [token_id(t) for t in lp.tokens]
    assert engine.model.tokenizer.decode(ids) == got.choices[0].text
    ref = reference_logprobs(engine, prompt_ids, ids)
    for t, (token, value, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs)):
        assert abs(value - ref[t, token].item()) < 1e-4
        best = ref[t].topk(3)
        assert [token_id(k) for k in top] == best.indices.tolist()
        assert torch.allclose(torch.tensor(list(top.values())), best.values, atol=1e-4)


def test_chat_logprobs_equal_log_softmax_of_score(client, engine):
    got = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    expected = engine.generate([CHAT], greedy(6))[0]
    tokenizer = engine.model.tokenizer
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in expected.token_ids]
    ref = reference_logprobs(engine, expected.prompt_token_ids, expected.token_ids)
    for t, (entry, token) in enumerate(zip(content, expected.token_ids)):
        assert abs(entry.logprob - ref[t, token].item()) < 1e-4
        assert entry.bytes == list(entry.token.encode())
        best = ref[t].topk(2)
        assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([i]) for i in best.indices.tolist()]
        assert torch.allclose(torch.tensor([a.logprob for a in entry.top_logprobs]), best.values, atol=1e-4)
    streamed = [c.choices[0].logprobs.content[0].logprob for c in client.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert torch.allclose(torch.tensor(streamed), torch.tensor([e.logprob for e in content]), atol=1e-5)


def test_every_block_is_free_afterwards(server, client):
    client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4)
    metrics = server.metrics()
    assert metrics["mla_func_kv_blocks_in_use"] == 0
    assert metrics["mla_func_requests_running"] == 0 and metrics["mla_func_requests_waiting"] == 0
    assert metrics["mla_func_time_to_first_token_seconds_count"] > 0
