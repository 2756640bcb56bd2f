"""One HTTP request's engine requests, seen from the event loop: submitted, awaited, aborted when left.

The engine's side (its thread, or the reader of its process) hands each pass's items over in one batch
(`deliver_on`: one `loop.call_soon_threadsafe`, the one way into an event loop from another thread),
which the event loop's thread fans out to the requests' streams. A stream keeps the items it was given
in a list and wakes its reader once, so a reader that fell behind takes every item waiting in one go.
`RequestStream.close` aborts whatever has not finished (a client gone, a timeout, an error while
answering), so a request never outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from mla_func.server.engine_driver import Admitted, Failure, Item
from mla_func.server.engine_loop import Batch, Deliver, EngineRunner, call_each
from mla_func.server.protocol import ApiError
from mla_func.serving.requests import ParamsLike, Prompt, RequestError, StreamEvent

_POLL_S = 1.0  # how often a request waiting for tokens checks for its client and its deadline


def deliver_on(loop: asyncio.AbstractEventLoop) -> Deliver:
    """`EngineLoop.start`'s deliver for sinks that live on `loop`: each batch is one wake-up of the loop,
    whose thread then calls the sinks (`RequestStream.put`) in order."""

    def deliver(batch: Batch) -> None:
        loop.call_soon_threadsafe(call_each, batch)

    return deliver


class Admission:
    """The bound on requests in the engine (running and waiting, each choice counted): beyond it, 429."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def acquire(self, count: int) -> None:
        if self.in_flight + count > self.limit:
            raise ApiError(429, f"the server is full: {self.in_flight} requests are running or waiting, at most "
                                f"{self.limit}; retry later", type="rate_limit_error", code="queue_full")
        self.in_flight += count

    def release(self, count: int) -> None:
        self.in_flight -= count


class RequestStream:
    """Submit prompts to the engine, then iterate their events until each choice completes.
    Its sink is `put`, called on the event loop's thread."""

    def __init__(self, engine_loop: EngineRunner, admission: Admission, timeout_s: float,
                 disconnected: Callable[[], Awaitable[bool]] | None = None):
        self._engine_loop = engine_loop
        self._admission = admission
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._disconnected = disconnected
        self._items: list[Item] = []  # given by the engine's side, not yet taken
        self._waiter: asyncio.Future[None] | None = None  # set while the reader waits for items
        self._timer: asyncio.TimerHandle | None = None  # the next `_tick`, armed while the reader reads
        self._unfinished: set[int] = set()
        self._admitted = 0

    async def submit(self, prompts: Sequence[Prompt], params: ParamsLike, choices: int, *,
                     prompt_field: str) -> tuple[int, ...]:
        """Queue the prompts (each with `choices` samples); their request ids. ApiError 429 when the
        server is full, 400 naming the field (`prompt_field` for the prompt) when the engine refuses one,
        503 when the engine ended before taking them."""
        self._admission.acquire(len(prompts) * choices)
        self._admitted = len(prompts) * choices
        self._engine_loop.submit(prompts, params, self.put)
        await self._wait()
        item = self._items.pop(0)
        if isinstance(item, RequestError):
            raise _refusal(item, len(prompts), prompt_field)
        if isinstance(item, Failure):
            raise ApiError(503, f"the engine is not running: {item.message}", type="server_error")
        assert isinstance(item, Admitted), item
        self._unfinished = set(item.request_ids)
        return item.request_ids

    def put(self, item: Item) -> None:
        """The sink: keep `item` and wake the reader if it waits. Called on the event loop's thread."""
        self._items.append(item)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():  # a reader cancelled while waiting leaves it done
            waiter.set_result(None)

    def _tick(self) -> None:
        """Wake the reader so that it checks its deadline and its client; the next tick follows at most
        `_POLL_S` seconds later. One timer for the stream's whole life, not one per wait: a stream waits
        once per token."""
        self._wake()
        self._timer = asyncio.get_running_loop().call_later(self._tick_delay(), self._tick)

    def _tick_delay(self) -> float:
        # The deadline's own tick, or a poll; past the deadline (a reader busy writing) a poll, never a spin.
        remaining = self._deadline - time.monotonic()
        return remaining if 0 < remaining < _POLL_S else _POLL_S

    async def batches(self) -> AsyncIterator[list[StreamEvent]]:
        """Every event until each choice's completion, as the lists of events that were waiting each time
        the reader came for more (never empty). ApiError 504 past the deadline, 500 if an iteration
        failed (after the events before the failure); `close` aborts what is left either way."""
        while self._unfinished:
            await self._wait()
            items, self._items = self._items, []
            events: list[StreamEvent] = []
            for item in items:
                if isinstance(item, Failure):
                    self._unfinished.clear()  # the engine aborted them
                    if events:
                        yield events
                    raise ApiError(500, f"generation failed: {item.message}", type="server_error")
                if isinstance(item, StreamEvent):
                    if item.completion is not None:
                        self._unfinished.discard(item.request_id)
                    events.append(item)
            if events:
                yield events

    async def _wait(self) -> None:
        """Until an item is waiting: ApiError 504 past the deadline, ConnectionAbortedError once the
        client of a whole (not streamed) response is gone, checked every `_POLL_S` seconds."""
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._timer = loop.call_later(self._tick_delay(), self._tick)
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise ApiError(504, f"the request took longer than the server's request timeout "
                                    f"({self._timeout_s:g} s)", type="timeout", code="request_timeout")
            if self._items:
                return
            # A future woken by `put` or `_tick` rather than asyncio.wait_for on a queue: no task or timer
            # per token.
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if not self._items and self._disconnected is not None and await self._disconnected():
                raise ConnectionAbortedError("the client disconnected")

    def close(self) -> None:
        """Abort the choices that have not finished; give back their places."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._unfinished:
            self._engine_loop.abort(tuple(self._unfinished))
            self._unfinished.clear()
        self._admission.release(self._admitted)
        self._admitted = 0


def _refusal(error: RequestError, num_prompts: int, prompt_field: str) -> ApiError:
    """The engine's refusal as a 400 naming the field: the prompt (too long, out of the vocabulary, a
    chat the template refuses) or a sampling field."""
    reason = error.reason
    if "SamplingParams." in reason:
        field = reason.split("SamplingParams.", 1)[1].split(" ", 1)[0]
        return ApiError(400, reason.replace("SamplingParams.", ""), param=field)
    where = f" (prompt {error.index})" if num_prompts > 1 and error.index is not None else ""
    code = "context_length_exceeded" if "maximum length" in reason else None
    return ApiError(400, reason + where, param=prompt_field, code=code)
