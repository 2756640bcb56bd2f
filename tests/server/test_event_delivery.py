"""How tokens travel from the engine (on a thread, or in a process of its own) to a response, without a
server: one batch of items per pass of the engine's loop, every request's waiting events taken at once,
and chunk events that are the bytes `json.dumps` of the whole chunk gives."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

import mla_func as mf
from mla_func.server.engine_loop import Admitted, Batch, EngineLoop, Failure
from mla_func.server.engine_process import EngineProcess, EngineRecipe
from mla_func.server.metrics import ServerMetrics
from mla_func.server.protocol import ApiError
from mla_func.server.request_stream import Admission, RequestStream, deliver_on
from mla_func.server.responses import ChunkEvents, envelope
from mla_func.serving.requests import StreamEvent

GREEDY = mf.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_chunk_events_are_json_dumps_of_the_whole_chunk():
    chunks = ChunkEvents("chat.completion.chunk", "chatcmpl-1", 17, 'a "model"')
    for choice in ({"index": 2, "delta": {"content": "é\n\"x\""}, "logprobs": None, "finish_reason": None},
                   {"index": 0, "delta": {}, "logprobs": {"content": []}, "finish_reason": "length"}):
        whole = envelope("chat.completion.chunk", "chatcmpl-1", 17, 'a "model"', [choice])
        assert chunks.event(choice) == f"data: {json.dumps(whole)}\n\n"


ENGINE = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, graphs=False)


@pytest.fixture(params=["thread", "process"])
def runner(request):
    """The engine on a thread of this process, or in a process of its own; with the metrics it records."""
    metrics = ServerMetrics()
    if request.param == "thread":
        yield EngineLoop(mf.Engine(mf.load_model("tiny", device="cpu"), **ENGINE), metrics), metrics
        return
    recipe = EngineRecipe("tiny", device="cpu", threads=1, engine_kwargs=ENGINE, warmup=False)
    with EngineProcess.launch(recipe, metrics, timeout_s=120, say=print) as process:
        yield process, metrics


def test_one_batch_per_iteration(runner):
    """Admissions go out as the commands are applied; then each iteration's events, all requests' together."""
    loop, metrics = runner
    batches: list[Batch] = []
    done = threading.Event()

    def deliver(batch: Batch) -> None:
        batches.append(batch)
        if sum(isinstance(i, StreamEvent) and i.completion is not None for b in batches for _, i in b) == 3:
            done.set()

    loop.start(deliver)
    loop.submit([[1, 2, 3], [4, 5, 6, 7], [8, 9]], GREEDY, lambda item: None)
    assert done.wait(60)
    report = loop.stop(timeout=60)
    assert report is not None and report.blocks_in_use == 0
    first, *iterations = batches
    assert [type(item) for _, item in first] == [Admitted]
    assert len(iterations) == GREEDY.max_tokens  # the three prompts fit one prefill step, then decode together
    assert all(sorted(item.index for _, item in batch if isinstance(item, StreamEvent)) == [0, 1, 2]
               for batch in iterations)
    counted = samples(metrics)
    assert counted["mla_func_generation_tokens_total"] == 9
    assert counted['mla_func_requests_finished_total{reason="length"}'] == 3
    assert counted["mla_func_kv_blocks_in_use"] == 0 and counted["mla_func_time_to_first_token_seconds_count"] == 3


def samples(metrics: ServerMetrics) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.render().decode().splitlines()
            if line and not line.startswith("#")}


class _Loop:
    """What `RequestStream` needs of an `EngineLoop`: admits every submission, records aborts."""

    def __init__(self) -> None:
        self.aborted: list[tuple[int, ...]] = []

    def submit(self, prompts, params, sink) -> None:
        deliver_on(asyncio.get_running_loop())([(sink, Admitted((7, 8)))])

    def abort(self, request_ids: tuple[int, ...]) -> None:
        self.aborted.append(request_ids)


def test_a_reader_takes_every_waiting_event_at_once_and_a_failure_after_them():
    async def main() -> tuple[list[list[int]], _Loop]:
        engine_loop = _Loop()
        stream = RequestStream(engine_loop, Admission(4), timeout_s=30)  # type: ignore[arg-type]
        assert await stream.submit([[1]], None, 2, prompt_field="prompt") == (7, 8)
        for token in range(3):
            stream.put(StreamEvent(0, token, request_id=7 + token % 2, choice=token % 2))
        got: list[list[int]] = []
        with pytest.raises(ApiError) as failed:
            async for events in stream.batches():
                got.append([e.token_id for e in events])
                if len(got) == 1:
                    stream.put(StreamEvent(0, 3, request_id=7))
                    stream.put(Failure("boom"))
        assert failed.value.status == 500
        stream.close()
        return got, engine_loop

    got, engine_loop = asyncio.run(main())
    assert got == [[0, 1, 2], [3]]
    assert engine_loop.aborted == []  # the failed iteration's requests were aborted by the engine's thread


def test_a_waiting_reader_meets_its_deadline():
    async def main() -> _Loop:
        engine_loop = _Loop()
        stream = RequestStream(engine_loop, Admission(4), timeout_s=0.2)  # type: ignore[arg-type]
        await stream.submit([[1]], None, 2, prompt_field="prompt")
        with pytest.raises(ApiError) as late:
            async for _ in stream.batches():
                pass
        assert late.value.status == 504
        stream.close()
        return engine_loop

    assert [sorted(ids) for ids in asyncio.run(main()).aborted] == [[7, 8]]
