"""The OpenAI API's response bodies: completions and chat completions, whole or as stream chunks.

Pure functions of the engine's values (`Completion`, `StreamEvent`, `TokenLogprob`) to JSON-ready
dicts. A token is named by its text (the tokenizer's decoding of that one token), or as
"token_id:N" when the request asks for ids (`return_tokens_as_token_ids`, as vLLM's server has it)
or the model has no tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mla_func.serving.requests import Completion, TokenLogprob, Tokenizer


@dataclass(frozen=True, slots=True)
class Naming:
    """How a response names tokens: by the tokenizer's text, or as "token_id:N"."""

    tokenizer: Tokenizer | None
    as_ids: bool

    def token(self, token_id: int) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def finish_reason(completion: Completion) -> str:
    """OpenAI's finish_reason: "stop" (a stop string or token, end of sequence) or "length"."""
    return "length" if completion.finish_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], naming: Naming,
                        offset: int = 0) -> dict[str, Any]:
    """The legacy completions API's logprobs of `token_ids`: tokens, their logprobs, each one's top
    alternatives, and each token's offset in the text (from `offset`, the text already sent)."""
    tokens = [naming.token(t) for t in token_ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{naming.token(t): v for t, v in lp.top.items()} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], naming: Naming) -> dict[str, Any]:
    """The chat API's logprobs: per token its text, logprob, UTF-8 bytes and top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = naming.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top.items()]}
                        for t, lp in zip(token_ids, logprobs)]}


def completion_choice(index: int, completion: Completion, naming: Naming) -> dict[str, Any]:
    logprobs = None if completion.logprobs is None else completion_logprobs(
        completion.token_ids, completion.logprobs, naming)
    return {"index": index, "text": completion.text or "", "logprobs": logprobs,
            "finish_reason": finish_reason(completion)}


def chat_choice(index: int, completion: Completion, naming: Naming) -> dict[str, Any]:
    logprobs = None if completion.logprobs is None else chat_logprobs(completion.token_ids, completion.logprobs, naming)
    return {"index": index, "message": {"role": "assistant", "content": completion.text or ""},
            "logprobs": logprobs, "finish_reason": finish_reason(completion)}


def envelope(kind: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
             usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """A response or chunk: kind is "text_completion", "chat.completion" or "chat.completion.chunk"."""
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


class ChunkEvents:
    """Server-sent events of one streamed response's chunks, each `envelope(...)` with one choice: the
    envelope's JSON is made once, and each chunk is that text around its choice's `json.dumps`, the very
    bytes `json.dumps` of the whole chunk gives, at a fraction of its cost per token."""

    def __init__(self, kind: str, request_id: str, created: int, model: str):
        whole = json.dumps(envelope(kind, request_id, created, model, []))
        assert whole.endswith('"choices": []}'), whole  # choices is the envelope's last key
        self._head = "data: " + whole[:-2]  # up to the choices' opening bracket

    def event(self, choice: dict[str, Any]) -> str:
        """The event of the chunk with this one choice."""
        return f"{self._head}{json.dumps(choice)}]}}\n\n"
