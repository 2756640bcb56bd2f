"""One HTTP request's engine requests, seen from the event loop: submitted, awaited, aborted when left.

The engine's thread hands items to an `asyncio.Queue` through `loop.call_soon_threadsafe`, the one
way into an event loop from another thread. `RequestStream.close` aborts whatever has not finished
(a client gone, a timeout, an error while answering), so a request never outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from mla_func.server.engine_loop import Admitted, EngineLoop, Failure, Item
from mla_func.server.protocol import ApiError
from mla_func.serving.requests import ParamsLike, Prompt, RequestError, StreamEvent

_POLL_S = 1.0  # how often a request waiting for tokens checks for its client and its deadline


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
    """Submit prompts to the engine's thread, then iterate their events until each choice completes."""

    def __init__(self, engine_loop: EngineLoop, admission: Admission, timeout_s: float,
                 disconnected: Callable[[], Awaitable[bool]] | None = None):
        self._engine_loop = engine_loop
        self._admission = admission
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._disconnected = disconnected
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._unfinished: set[int] = set()
        self._admitted = 0

    async def submit(self, prompts: Sequence[Prompt], params: ParamsLike, choices: int, *,
                     prompt_field: str) -> tuple[int, ...]:
        """Queue the prompts (each with `choices` samples); their request ids. ApiError 429 when the
        server is full, 400 naming the field (`prompt_field` for the prompt) when the engine refuses one."""
        self._admission.acquire(len(prompts) * choices)
        self._admitted = len(prompts) * choices
        loop = asyncio.get_running_loop()
        self._engine_loop.submit(prompts, params, lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item))
        item = await self._next()
        if isinstance(item, RequestError):
            raise _refusal(item, len(prompts), prompt_field)
        assert isinstance(item, Admitted), item
        self._unfinished = set(item.request_ids)
        return item.request_ids

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Every event until each choice's completion. ApiError 504 past the deadline, 500 if an iteration
        failed; `close` aborts what is left either way."""
        while self._unfinished:
            item = await self._next()
            if isinstance(item, Failure):
                self._unfinished.clear()  # the engine's thread aborted them
                raise ApiError(500, f"generation failed: {item.message}", type="server_error")
            if isinstance(item, StreamEvent):
                if item.completion is not None:
                    self._unfinished.discard(item.request_id)
                yield item

    async def _next(self) -> Item:
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise ApiError(504, f"the request took longer than the server's request timeout "
                                    f"({self._timeout_s:g} s)", type="timeout", code="request_timeout")
            try:
                return await asyncio.wait_for(self._queue.get(), min(remaining, _POLL_S))
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                if self._disconnected is not None and await self._disconnected():
                    raise ConnectionAbortedError("the client disconnected") from None

    def close(self) -> None:
        """Abort the choices that have not finished; give back their places."""
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
