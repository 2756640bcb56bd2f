"""The bodies of the OpenAI API's requests, checked by pydantic, and the error object every refusal is.

Each body is a pydantic model with `extra="forbid"` and strict types, so an unknown field, a value of
the wrong type (nothing is coerced: "3" is not 3) or out of range is refused with an `ApiError` naming
the field. Fields the server does not support yet (tools, structured output, ...) are refused by name
with a message that says so. `sampling_params` then builds the engine's `SamplingParams`, whose own
checks name the field too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mla_func.serving.sampling import MAX_CHOICES, MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "parse_body"]

# Fields of OpenAI's API the server refuses by name (an unknown field is refused as unknown).
NOT_SUPPORTED = {
    "tools": "tool calls", "tool_choice": "tool calls", "functions": "function calls",
    "function_call": "function calls", "parallel_tool_calls": "tool calls", "response_format": "structured output",
    "logit_bias": "logit_bias", "suffix": "suffix", "audio": "audio output", "modalities": "audio output",
    "prediction": "predicted outputs", "web_search_options": "web search", "service_tier": "service tiers",
    "store": "stored completions", "metadata": "stored completions", "reasoning_effort": "reasoning effort",
}


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object.

    param: the request field at fault ("temperature", "messages[0].content"), or None.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """The fields both endpoints share. Past OpenAI's own: top_k, min_tokens, repetition_penalty,
    ignore_eos, stop_token_ids and return_tokens_as_token_ids, as vLLM's server names them."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = ()
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    top_k: int = Field(0, ge=-1)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, le=1e6)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        stops = (value,) if isinstance(value, str) else value if value is not None else ()
        if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of them")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        return tuple(stops)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or a list of token id lists."""

    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or _token_ids(value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, str) or _token_ids(p) for p in value):
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token id lists")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (a list of them is a batch; a list of ints is one prompt)."""
        if isinstance(self.prompt, str) or _token_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message. OpenAI's "developer" role is the system's; content may be text parts, joined."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


Body = TypeVar("Body", bound=_Body)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """The request body as `model`; ApiError 400 naming the field for malformed JSON, a body that is not
    an object, an unsupported or unknown field, or a bad value."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    for name in data:
        if name in NOT_SUPPORTED:
            raise ApiError(400, f"'{name}' is not supported by this server ({NOT_SUPPORTED[name]} are not "
                                "implemented yet)", param=name, code="unsupported_parameter")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        param = _param(error["loc"])
        if error["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown field '{param}'", param=param, code="unknown_parameter") from None
        if error["type"] == "missing":
            raise ApiError(400, f"'{param}' is required", param=param) from None
        message = str(error["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"'{param}': {message}, got {_short(error.get('input'))}", param=param) from None


def _param(loc: Sequence[int | str]) -> str:
    """pydantic's location as the API names it: messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]") and out:
            continue  # which member of a union was tried, not a field
        else:
            out += f".{part}" if out else part
    return out


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | list | Mapping) or value is None \
        else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


# The API's name of each SamplingParams field whose check can fail after pydantic's.
_API_NAMES = {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "stop": "stop", "logprobs": "logprobs",
              "stop_token_ids": "stop_token_ids", "top_k": "top_k", "n": "n"}


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_model_len: int) -> SamplingParams:
    """The engine's SamplingParams of a checked body; ApiError 400 naming the field if they disagree
    (min_tokens above max_tokens, logprobs on a chat without top_logprobs' switch, ...)."""
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        if body.echo:
            raise ApiError(400, "'echo' is not supported by this server (the prompt's logprobs are in the Python "
                                "API only: SamplingParams.prompt_logprobs)", param="echo", code="unsupported_parameter")
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, f"'best_of' must equal 'n' ({body.n}) if given: ranking samples is not implemented",
                           param="best_of", code="unsupported_parameter")
        max_tokens, logprobs = body.max_tokens or 16, body.logprobs
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k, 0), max_tokens=max_tokens,
            seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, min_tokens=body.min_tokens, stop=body.stop,
            logprobs=logprobs, n=body.n)
    except ValueError as e:
        field = str(e).removeprefix("SamplingParams.").split(" ", 1)[0]
        param = "max_completion_tokens" if field == "max_tokens" and isinstance(body, ChatCompletionRequest) \
            and body.max_completion_tokens else _API_NAMES.get(field)
        raise ApiError(400, str(e).replace("SamplingParams.", ""), param=param) from None
