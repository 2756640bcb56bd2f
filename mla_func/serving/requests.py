"""Requests: what a caller may hand to `Engine.generate` / `generate_stream` / `score`, checked in one place.

Every check of request-level input is here, and the only exception it raises is
`RequestError`, whatever Python value it is given. Checking has no side effects:
the engine checks every request of a call first and only then queues the valid
ones, so the scheduler never holds a request whose checks did not finish.

Accepted prompts: a string (tokenized with the model's tokenizer, which must
exist), or token ids as a list, tuple or range of ints, or a 1-D integer tensor, or a chat: a
list of messages ({"role": "system" | "user" | "assistant", "content": str}), rendered by the
model's chat template (`Model.chat_template`, which must exist) ending with the assistant's turn,
then tokenized without the tokenizer's added special tokens (the template writes its own).
Token ids must be ints (not bools, floats or strings: nothing is coerced) in
[0, vocab_size). An empty prompt is refused, text or ids alike: to generate
from the start of a sequence, pass the beginning-of-sequence id.
`generate("text")` is one prompt, the same as `generate(["text"])`; so is a chat: a list whose
items are all message dicts is one chat prompt (`generate(messages)`), and a batch of chats is
a list of them (`generate([chat_a, chat_b])`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tokenizers.decoders import DecodeStream

from mla_func.checkpoint.chat_template import ChatError, ChatTemplate
from mla_func.serving.sampling import SamplingParams, describe, request_seed

ChatMessages = Sequence[Mapping[str, str]]  # {"role": ..., "content": ...} dicts
Prompt = str | Sequence[int] | ChatMessages
ParamsLike = SamplingParams | Mapping[str, Any] | None


class RequestError(ValueError):
    """A request is invalid; the message names it by the caller's index. The others still run.

    index is None when the call as a whole is invalid (prompts not a list, a
    params list of the wrong length): then nothing ran.
    """

    def __init__(self, index: int | None, message: str):
        super().__init__(message if index is None else f"request {index}: {message}")
        self.index = index
        self.reason = message  # the message without the request's index, for a caller that names it its own way


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprobs of one generated token (`SamplingParams.logprobs`).

    logprob: the token's own, float32 log-softmax of the logits it was drawn from (after penalties,
             before temperature, top-k and top-p; a prompt token's: of the logits at the position
             before it, `SamplingParams.prompt_logprobs`).
    top:     token id -> logprob of the row's `logprobs` most likely tokens, most likely first (the
             drawn token is among them only if it is one of them).
    """

    logprob: float
    top: dict[int, float]


@dataclass(frozen=True, slots=True)
class Completion:
    """The result of one prompt.

    finish_reason: "stop" (a stop or end-of-sequence token, or a stop string), "length" (max_tokens
    or the model's maximum length), "abort", or "error" (then `error` says why and
    token_ids is empty).
    logprobs: with `SamplingParams.logprobs` set, one `TokenLogprob` per token of token_ids; else None.
    choice: which of the prompt's `SamplingParams.n` samples this is (0 to n - 1).
    prompt_logprobs: with `SamplingParams.prompt_logprobs` set, one entry per prompt token: None for the
    first (nothing precedes it), then each token's `TokenLogprob` given the tokens before it; else None.
    """

    index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    text: str | None = None
    error: RequestError | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    choice: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def raise_for_error(self) -> Completion:
        if self.error is not None:
            raise self.error
        return self


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One sampled token of one request; `completion` is set on its last event (token_id -1 on an error).

    text: for a request with `SamplingParams.stop` strings, the text this token releases (possibly
    empty): characters that could begin a stop string are held back until decided, so the stream
    never shows text past a stop string, and the events' texts join to the completion's. None for
    a request without stop strings (decode its token ids, as `mla_func.cli.streaming` does), unless it
    was added with `Engine.add_request(..., stream_text=True)`.
    request_id: the engine's id of the request (`Engine.add_request` returns it); -1 on an error event.
    choice: which of its prompt's `SamplingParams.n` samples the token belongs to.
    logprob: the token's logprobs, for a request with `SamplingParams.logprobs`; else None.
    """

    index: int
    token_id: int
    completion: Completion | None = None
    text: str | None = None
    request_id: int = -1
    choice: int = 0
    logprob: TokenLogprob | None = None


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> Any: ...

    def decode(self, ids: list[int]) -> str: ...


class StopText:
    """The generated text of one request with stop strings, decoded a token at a time.

    Detokenised by the tokenizer's `DecodeStream` (one token's decode a step, a character split over
    tokens held until complete). Only `pending` is searched: the text not yet released, which is at
    most the longest stop string less one character, plus the new text. Text before it was released
    because no stop string can begin there, so only `pending` can hold a new match.
    """

    __slots__ = ("stops", "longest", "decoder", "released", "pending", "stopped")

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops  # none: the text is only decoded, a token at a time
        self.longest = max((len(s) for s in stops), default=0)
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.released: list[str] = []
        self.pending = ""
        self.stopped = False  # a stop string was found: the text ends before it

    def push(self, tokenizer: Any, token_id: int) -> str:
        """Decode one more token; returns the text it releases. Sets `stopped` if a stop string appears."""
        piece = self.decoder.step(tokenizer, token_id)
        if not piece:
            return ""
        pending = self.pending + piece
        matches = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if matches:
            cut, self.stopped, self.pending = min(matches), True, ""
        else:
            # Hold back the longest tail that a stop string could still begin with.
            cut = next((k for k in range(max(0, len(pending) - self.longest + 1), len(pending))
                        if any(s.startswith(pending[k:]) for s in self.stops)), len(pending))
            self.pending = pending[cut:]
        out = pending[:cut]
        if out:
            self.released.append(out)
        return out

    def flush(self) -> str:
        """The held-back text, released at a finish without a stop string."""
        out, self.pending = self.pending, ""
        if out:
            self.released.append(out)
        return out

    @property
    def text(self) -> str:
        """All text released so far: at a stop, the completion's text (up to the stop string)."""
        return "".join(self.released)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the engine can take: the model's vocabulary and end-of-sequence ids, the cache's size."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    block_size: int
    num_usable_blocks: int
    tokenizer: Tokenizer | None
    speculative_tokens: int = 0  # drafts a decode step verifies (0: none)
    chat_template: ChatTemplate | None = None  # renders chat prompts; None: the model has none
    # The most tokens one sequence can hold in the cache (`GroupedAllocator.num_usable_tokens`: the scarcest
    # cache group decides, and a group with a lookback may not limit it at all); None: the usable blocks'.
    max_sequence_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request that passed every check. stop_token_ids: the params' own plus, unless ignore_eos, EOS.

    plain: its tokens are the argmax of its raw logits rows (greedy, no penalties, no min_tokens)
    and it asks for no logprobs; decided once here, so a step's draw can take the argmax of a
    batch of plain rows without looking at each request's settings again.
    """

    index: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stop_token_ids: tuple[int, ...]
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        object.__setattr__(self, "plain", p.greedy and not p.penalised and p.min_tokens == 0 and p.logprobs is None)


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """A request the engine is generating for: what every draw of its tokens reads.

    request:          the checked request (its params, prompt and stop ids)
    seed:             its sampling seed (`choice_seed`): with a token's position, its draw's key
    request_id:       the engine's id of it (one per choice of the request)
    choice:           which of the request's `SamplingParams.n` samples it is
    output_token_ids: the tokens streamed to the caller so far, the context its penalties and
                      min_tokens count. The record's fields never change, but this list grows in
                      place: the engine's host loop appends each token as it streams it, so a step
                      allocates no new record or list for a request.
    stop_text:        for a request with stop strings (or whose events carry text), its text so far
                      (`StopText`, which grows in place too); None otherwise.
    logprobs:         for a request with `SamplingParams.logprobs`, those of each token drawn so far
                      (the engine appends them as it draws); None otherwise.
    prompt_logprobs:  for a request with `SamplingParams.prompt_logprobs`, its prompt's (as
                      `Completion.prompt_logprobs`), scored before it was queued; None otherwise.
    """

    request: CheckedRequest
    seed: int
    request_id: int = 0
    choice: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    stop_text: StopText | None = None  # the decoded text, for a request with stop strings
    logprobs: list[TokenLogprob] | None = None  # one per drawn token, for a request with logprobs
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


def choice_seed(params: SamplingParams, choice: int, rng: random.Random) -> int:
    """The seed of one of a request's `SamplingParams.n` samples: `request_seed` for the first (so n = 1
    samples as before), and for each later one, with a seed given, a hash of (seed, choice), so that a
    seeded request gives the same n samples every time; without one, a fresh draw from `rng`."""
    if choice == 0 or params.seed is None:
        return request_seed(params, rng)
    digest = hashlib.blake2b(f"{params.seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def split_call(prompts: object, params: object) -> list[tuple[object, object]]:
    """(prompt, params) per request of one call; RequestError(None) if the call itself is malformed."""
    if isinstance(prompts, str) or _is_one_chat(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise RequestError(None, f"prompts must be a list of prompts (strings, token id lists or chats), got "
                                 f"{type(prompts).__name__}")
    if params is None or isinstance(params, (SamplingParams, Mapping)):
        return [(p, params) for p in prompts]
    if not isinstance(params, (list, tuple)):
        raise RequestError(None, "params must be a SamplingParams, a mapping of its fields, None, or a list of "
                                 f"those (one per prompt), got {type(params).__name__}")
    if len(params) != len(prompts):
        raise RequestError(None, f"params: expected one per prompt ({len(prompts)}), got {len(params)}")
    return list(zip(prompts, params))


def _is_one_chat(prompts: object) -> bool:
    # Every item a message: one chat. (A message dict is never a prompt of its own, so a list of them
    # cannot be meant as a batch; a list mixing messages and prompts stays a batch, each checked alone.)
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(isinstance(m, Mapping) for m in prompts)


def is_chat(prompt: object) -> bool:
    """Whether a prompt is meant as a chat: a list or tuple holding a message dict (token ids never are)."""
    # A chat never starts with a token id, and a prompt of token ids is thousands of them: its first item
    # decides without a walk (a dict further into a list of ids is then refused as a bad token id).
    return (isinstance(prompt, (list, tuple)) and bool(prompt) and type(prompt[0]) is not int
            and any(isinstance(m, Mapping) for m in prompt))


def chat_token_ids(index: int | None, messages: object, limits: Limits) -> tuple[int, ...]:
    """The token ids of a chat prompt: rendered by the model's template, tokenized, checked as a prompt.

    RequestError when the model has no chat template or tokenizer, a message is bad (naming its index and
    field), or the template refuses the chat.
    """
    if limits.chat_template is None:
        raise RequestError(index, "the prompt is a chat (a list of messages) but the model has no chat template "
                                  "(tokenizer_config.json 'chat_template' or chat_template.jinja); pass text or "
                                  "token ids")
    if limits.tokenizer is None:
        raise RequestError(index, "the prompt is a chat but the model has no tokenizer.json to tokenize it")
    try:
        text = limits.chat_template.render(messages)  # type: ignore[arg-type]  # render checks what it is given
    except ChatError as e:
        raise RequestError(index, f"chat: {e}") from None
    if not text:
        raise RequestError(index, "the chat template rendered the chat as empty text")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise RequestError(index, "the chat holds a lone surrogate, which is not text a tokenizer can encode")
    # The template writes the special tokens it wants (a beginning-of-sequence token among them).
    return check_token_ids(index, tuple(limits.tokenizer.encode(text, add_special_tokens=False).ids), limits)


def check_params(index: int | None, params: object) -> SamplingParams:
    """SamplingParams from a SamplingParams, a mapping of its fields, or None (the defaults)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if not isinstance(params, Mapping):
        raise RequestError(index, f"params must be a SamplingParams, a mapping of its fields or None, got "
                                  f"{type(params).__name__}")
    bad_keys = [k for k in params if not isinstance(k, str) or k not in SamplingParams.__dataclass_fields__]
    if bad_keys:
        raise RequestError(index, f"unknown SamplingParams fields {describe(bad_keys)}; expected some of "
                                  f"{sorted(SamplingParams.__dataclass_fields__)}")
    try:
        return SamplingParams(**params)
    except ValueError as e:  # SamplingParams' own checks, which name the field and value
        raise RequestError(index, str(e)) from None


def check_token_ids(index: int | None, prompt: object, limits: Limits, *, what: str = "the prompt") -> tuple[int, ...]:
    """The token ids of a prompt (text is tokenized); see the module docstring for what is accepted."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(index, f"{what} is empty")
        if limits.tokenizer is None:
            raise RequestError(index, f"{what} is text but the model has no tokenizer.json; pass token ids")
        if any(0xD800 <= ord(c) <= 0xDFFF for c in prompt):
            raise RequestError(index, f"{what} holds a lone surrogate, which is not text a tokenizer can encode")
        return check_token_ids(index, tuple(limits.tokenizer.encode(prompt).ids), limits, what=what)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            raise RequestError(index, f"{what} as a tensor must be 1-D of an integer dtype, got "
                                      f"{tuple(prompt.shape)} {prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise RequestError(index, f"{what} must be a string or a list/tuple/range of token ids, got "
                                  f"{type(prompt).__name__}")
    ids = tuple(prompt)
    if not ids:
        raise RequestError(index, f"{what} is empty")
    # A prompt is thousands of ids, checked once per request: the common case in C loops (the types, then
    # min and max); only a prompt that fails one is walked in Python, to name what is wrong.
    if set(map(type, ids)) != {int}:
        for position, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise RequestError(index, f"token ids must be ints, got {describe(t)} ({type(t).__name__}) "
                                          f"at position {position}")
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        raise RequestError(index, f"token ids must be in [0, {limits.vocab_size}), got {describe(bad[:8])}")
    return ids


def check_request(index: int, prompt: object, params: object, limits: Limits) -> CheckedRequest:
    """Every check of one generation request; RequestError(index) naming the first that fails."""
    checked = check_params(index, params)
    ids = chat_token_ids(index, prompt, limits) if is_chat(prompt) else check_token_ids(index, prompt, limits)
    vocab = limits.vocab_size
    bad_stops = [t for t in checked.stop_token_ids if t >= vocab]
    if bad_stops:
        raise RequestError(index, f"SamplingParams.stop_token_ids must be in [0, {vocab}), got {describe(bad_stops)}")
    if checked.stop and limits.tokenizer is None:
        raise RequestError(index, "SamplingParams.stop needs the model's tokenizer (tokenizer.json) to find the "
                                  f"strings in the text; this model has none: use stop_token_ids, got "
                                  f"{describe(checked.stop)}")
    if checked.logprobs is not None and limits.speculative_tokens:
        # A verify row's tokens are drawn in `mla_func.serving.speculative`, which does not return logprobs.
        raise RequestError(index, f"SamplingParams.logprobs {checked.logprobs} is not supported with speculative "
                                  f"decoding (Engine speculative_tokens={limits.speculative_tokens}); use an "
                                  "engine without drafts")
    stop = checked.stop_token_ids if checked.ignore_eos else checked.stop_token_ids + limits.eos_token_ids
    if checked.min_tokens and len(set(stop)) >= vocab:
        raise RequestError(index, f"min_tokens {checked.min_tokens} with every token of the vocabulary a stop token "
                                  "leaves nothing to sample")
    if len(ids) >= limits.max_model_len:
        raise RequestError(index, f"the prompt has {len(ids)} tokens; the maximum length is {limits.max_model_len} "
                                  "(prompt plus at least one generated token)")
    # The scheduler's own bound, checked here so that queuing cannot fail: the last
    # sampled token is never fed back, so the cache holds at most max_len - 1 tokens.
    max_len = min(len(ids) + checked.max_tokens, limits.max_model_len)
    blocks = -(-(max_len - 1) // limits.block_size)
    in_blocks = limits.num_usable_blocks * limits.block_size
    longest = in_blocks if limits.max_sequence_tokens is None else limits.max_sequence_tokens
    if max_len - 1 > longest:
        scarcest = ("" if longest == in_blocks else
                    f" (another cache group is scarcer: one sequence can hold at most {longest} tokens)")
        raise RequestError(index, f"needs up to {blocks} KV blocks ({max_len - 1} tokens) but the cache has only "
                                  f"{limits.num_usable_blocks} usable blocks of {limits.block_size} tokens{scarcest}")
    return CheckedRequest(index, ids, checked, stop)


def check_score_ids(token_ids: object, limits: Limits) -> tuple[int, ...]:
    """The token ids `Engine.score` may run: a prompt's checks, with up to max_model_len tokens."""
    ids = check_token_ids(None, token_ids, limits, what="score: token_ids")
    if len(ids) > limits.max_model_len:
        raise RequestError(None, f"score: {len(ids)} tokens exceed max_model_len {limits.max_model_len}")
    return ids
