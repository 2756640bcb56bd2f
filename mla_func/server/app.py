"""The HTTP application: OpenAI's endpoints on Starlette, over an `EngineRunner` (the engine on a thread
of this process, or in a process of its own).

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    GET  /v1/models, /health, /metrics

Every refusal is OpenAI's error object with its status (400 naming the field, 404 for an unknown
model or path, 429 when the engine's queue is full, 503 when the engine is not running, 504 past the
request timeout). A handler never touches the engine: it checks the body, submits the request to the
engine's runner and turns the events it gets back into a response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from mla_func.server.engine_loop import EngineRunner
from mla_func.server.metrics import ServerMetrics
from mla_func.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_body, sampling_params
from mla_func.server.request_stream import Admission, RequestStream, deliver_on
from mla_func.server.responses import (ChunkEvents, Naming, chat_choice, chat_logprobs, completion_choice,
                                       completion_logprobs, envelope, finish_reason, usage)
from mla_func.serving.requests import Completion, Prompt, StreamEvent, Tokenizer

__all__ = ["ServerSettings", "build_app"]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What the handlers need to know of the model and the server's limits.

    model_name:       the name requests must give as "model" (others get 404)
    max_model_len:    the engine's; a chat without max_tokens may generate up to it
    tokenizer:        the model's, to name tokens in logprobs (None: tokens are named "token_id:N")
    max_requests:     requests (choices) in the engine at once, running and waiting; beyond it, 429
    request_timeout_s: a request still running after this many seconds is aborted (504)
    """

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer | None
    max_requests: int
    request_timeout_s: float


def build_app(engine_loop: EngineRunner, metrics: ServerMetrics, settings: ServerSettings,
              say: Callable[[str], None]) -> Starlette:
    """The Starlette application. Its lifespan starts `engine_loop` and, at shutdown (once the server has
    stopped taking connections and finished or cut the open ones), stops it: every request left is
    aborted and its blocks freed, and `say` reports what was left."""
    handlers = _Handlers(engine_loop, metrics, settings, Admission(settings.max_requests))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine_loop.start(deliver_on(asyncio.get_running_loop()))
        say(f"serving {settings.model_name}")
        yield
        report = engine_loop.stop(timeout=60.0)
        if report is None:
            say("shutdown: the engine did not stop cleanly within 60 s (an iteration still running, or its "
                "process gone)")
        else:
            say(f"shutdown: {report.aborted} requests aborted, {report.blocks_in_use} KV blocks in use")

    routes = [
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/metrics", handlers.metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error},
                     lifespan=lifespan)


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, error: Exception) -> Response:
    # Starlette's own refusals (no such path, a method the path does not take) in OpenAI's error object.
    assert isinstance(error, HTTPException)
    what = f"no such path: {request.method} {request.url.path}" if error.status_code == 404 else error.detail
    return JSONResponse(ApiError(error.status_code, what).body(), status_code=error.status_code)


def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that call `on_close` as the response ends, however it ends (a client gone
    included, or before the first event), so the requests it streams are aborted at once, not when
    the generator is collected."""

    def __init__(self, source: AsyncGenerator[bytes, None], on_close: Callable[[], None]):
        super().__init__(source, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._source, self._on_close = source, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._source.aclose()
            self._on_close()


@dataclass(frozen=True, slots=True)
class _Call:
    """One checked request: its prompts, sampling params, whether it is a chat, and its response's names."""

    body: CompletionRequest | ChatCompletionRequest
    prompts: list[Prompt]
    chat: bool
    response_id: str
    created: int
    naming: Naming

    def choice_index(self, event_index: int, choice: int) -> int:
        # OpenAI numbers a batch's choices prompt by prompt: prompt i's n samples are i*n .. i*n + n - 1.
        return event_index * self.body.n + choice


class _Handlers:
    def __init__(self, engine_loop: EngineRunner, metrics: ServerMetrics, settings: ServerSettings,
                 admission: Admission):
        self.engine_loop, self.metrics_, self.settings, self.admission = engine_loop, metrics, settings, admission

    async def health(self, request: Request) -> Response:
        if not self.engine_loop.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(self.metrics_.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        model = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "mla-func",
                 "max_model_len": self.settings.max_model_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        return await self._generate(request, body, list(body.prompts()), chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        return await self._generate(request, body, [[m.as_dict() for m in body.messages]], chat=True)

    async def _generate(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                        prompts: list[Prompt], *, chat: bool) -> Response:
        settings = self.settings
        if body.model != settings.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server runs '{settings.model_name}'",
                           param="model", code="model_not_found")
        if not self.engine_loop.alive:
            raise ApiError(503, "the engine is not running (the server is shutting down, or the engine's process "
                                "ended)", type="server_error")
        params = sampling_params(body, settings.max_model_len)
        call = _Call(body, prompts, chat, f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
                     int(time.time()), Naming(settings.tokenizer, body.return_tokens_as_token_ids))
        stream = RequestStream(self.engine_loop, self.admission, settings.request_timeout_s,
                               disconnected=None if body.stream else request.is_disconnected)
        try:
            await stream.submit(prompts, params, body.n, prompt_field="messages" if chat else "prompt")
            if body.stream:
                return EventStream(self._chunks(call, stream), on_close=stream.close)
            return JSONResponse(await self._whole(call, stream))
        except BaseException:
            stream.close()
            raise
        finally:
            if not body.stream:
                stream.close()

    async def _whole(self, call: _Call, stream: RequestStream) -> dict[str, Any]:
        completions: dict[int, Completion] = {}
        async for events in stream.batches():
            for event in events:
                if event.completion is not None:
                    completions[call.choice_index(event.index, event.choice)] = event.completion
        ordered = [completions[i] for i in sorted(completions)]
        choose = chat_choice if call.chat else completion_choice
        choices = [choose(i, c, call.naming) for i, c in zip(sorted(completions), ordered)]
        prompt_tokens = sum(len(c.prompt_token_ids) for c in ordered if c.choice == 0)
        return envelope("chat.completion" if call.chat else "text_completion", call.response_id, call.created,
                        call.body.model, choices, usage(prompt_tokens, sum(len(c.token_ids) for c in ordered)))

    async def _chunks(self, call: _Call, stream: RequestStream) -> AsyncGenerator[bytes, None]:
        """The response's events. Every token has its own event; the events of the tokens waiting when
        the response is written go out in one write, so a client that fell behind (or a busy server)
        costs one write per request and iteration, not one per token."""
        kind = "chat.completion.chunk" if call.chat else "text_completion"
        chunks = ChunkEvents(kind, call.response_id, call.created, call.body.model)
        offsets: dict[int, int] = {}  # choice -> characters of text sent (the completions API's text_offset)
        prompt_tokens = completion_tokens = 0
        try:
            if call.chat:  # the first chunk of each choice gives the role
                yield _sse(envelope(kind, call.response_id, call.created, call.body.model, [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(len(call.prompts) * call.body.n)])).encode()
            async for events in stream.batches():
                text = []
                for event in events:
                    index = call.choice_index(event.index, event.choice)
                    if event.completion is not None and event.completion.choice == 0:
                        prompt_tokens += len(event.completion.prompt_token_ids)
                    text.append(chunks.event(self._chunk_choice(call, index, event, offsets)))
                completion_tokens += len(events)
                yield "".join(text).encode()
            options = call.body.stream_options
            if options is not None and options.include_usage:
                yield _sse(envelope(kind, call.response_id, call.created, call.body.model, [],
                                    usage(prompt_tokens, completion_tokens))).encode()
            yield _sse("[DONE]").encode()
        except ApiError as error:  # the status was sent with the first chunk: the error is an event
            yield _sse(error.body()).encode()

    @staticmethod
    def _chunk_choice(call: _Call, index: int, event: StreamEvent, offsets: dict[int, int]) -> dict[str, Any]:
        """The chunk of one token: its text (possibly empty: held back while a stop string may be starting,
        or a model without a tokenizer), its logprobs, and the finish reason on its choice's last token.
        Every token has its chunk, so a client counts tokens and times each one."""
        text = event.text or ""
        completion = event.completion
        reason = None if completion is None else finish_reason(completion)
        logprobs = None
        if event.logprob is not None:
            if call.chat:
                logprobs = chat_logprobs([event.token_id], [event.logprob], call.naming)
            else:
                logprobs = completion_logprobs([event.token_id], [event.logprob], call.naming, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(text)
        if call.chat:
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
