"""Load on loopback: 200 concurrent streaming clients, one in five leaving mid-stream. Every other
client gets exactly the tokens of its prompt run alone (greedy; the server's engine is batch-invariant),
no KV block is held afterwards, and the server's memory stays flat over a second round."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

import mla_func as mf
from support.server_process import start_server, stopped_cleanly

CLIENTS, PROMPTS, MAX_TOKENS, LEAVE_AFTER = 200, 20, 6, 2
RSS_GROWTH_BOUND = 32 << 20  # bytes a second round of the same load may add to the server's resident memory


@pytest.fixture(scope="module")
def server():
    process = start_server("--model", "demo", "--batch-invariant", "--max-num-seqs", "64")
    yield process
    stopped_cleanly(process)


@pytest.fixture(scope="module")
def alone():
    """Each prompt's token ids, from an engine of the same settings running it alone."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4096) for _ in range(rng.randrange(3, 12))] for _ in range(PROMPTS)]
    engine = mf.Engine(mf.load_model("demo", device="cpu"), batch_invariant=True, max_num_seqs=64, graphs=False)
    params = mf.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [(p, engine.generate([p], params)[0].token_ids) for p in prompts]


async def one_client(client: openai.AsyncOpenAI, prompt: list[int], leave: bool) -> list[int] | None:
    """The token ids a streaming client receives, or None for one that leaves after a few chunks."""
    stream = await client.completions.create(
        model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    tokens: list[int] = []
    async for chunk in stream:
        logprobs = chunk.choices[0].logprobs
        tokens += [int(t.removeprefix("token_id:")) for t in (logprobs.tokens if logprobs else [])]
        if leave and len(tokens) >= LEAVE_AFTER:
            await stream.close()
            return None
    return tokens


async def round_of_clients(url: str, alone) -> tuple[int, int]:
    """Run every client at once; returns (clients that completed with their tokens alone, clients that left)."""
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as client:
        cases = [(alone[i % PROMPTS], i % 5 == 4) for i in range(CLIENTS)]
        results = await asyncio.wait_for(asyncio.gather(*(one_client(client, p, leave) for (p, _), leave in cases)),
                                         timeout=240)
    for ((_, expected), leave), got in zip(cases, results):
        assert got is None if leave else got == list(expected)
    return sum(r is not None for r in results), sum(r is None for r in results)


def test_concurrent_streams_with_disconnects(server, alone):
    completed, left = asyncio.run(round_of_clients(server.base_url, alone))
    assert (completed, left) == (160, 40)
    after_first = server.rss_bytes()
    metrics = server.metrics()
    assert metrics["mla_func_kv_blocks_in_use"] == 0
    assert metrics["mla_func_requests_running"] == 0 and metrics["mla_func_requests_waiting"] == 0
    assert metrics['mla_func_requests_finished_total{reason="length"}'] >= completed
    asyncio.run(round_of_clients(server.base_url, alone))
    assert server.metrics()["mla_func_kv_blocks_in_use"] == 0
    growth = server.rss_bytes() - after_first
    assert growth < RSS_GROWTH_BOUND, f"the server's resident memory grew by {growth >> 20} MiB in a second round"
