"""Streaming one completion to a terminal: text as it is decoded, then a summary line.

Text is detokenised incrementally by the tokenizer's own `DecodeStream`, which
holds back a token that ends inside a multi-byte character until the character
is complete, so each step costs one token's decode whatever the output's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

from tokenizers.decoders import DecodeStream

from mla_func.serving.engine import Engine
from mla_func.serving.requests import Completion, TokenLogprob, chat_token_ids
from mla_func.serving.sampling import SamplingParams

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a program stopped by Ctrl-C


@dataclass(frozen=True, slots=True)
class StreamStats:
    """What the summary line reports; times are `time.perf_counter()` readings."""

    prompt_tokens: int
    generated_tokens: int
    started: float
    first_token_at: float | None
    finished: float
    finish_reason: str
    drafted: int = 0      # speculative decoding: drafts proposed and accepted (0 and 0 without it)
    accepted: int = 0
    seed: int | None = None  # the sampling seed, shown so that --seed can repeat the run; None when greedy

    def summary(self) -> str:
        first = self.first_token_at if self.first_token_at is not None else self.finished
        decode_time = self.finished - first
        # The rate counts tokens after the first: the first one's time is the prefill's.
        rate = (self.generated_tokens - 1) / decode_time if self.generated_tokens > 1 and decode_time > 0 else float("nan")
        return (
            f"[prompt tokens {self.prompt_tokens}, generated tokens {self.generated_tokens}, "
            f"time to first token {(first - self.started) * 1e3:.0f} ms, {rate:.1f} tokens/s, "
            + (f"seed {self.seed}, " if self.seed is not None else "")
            + (f"acceptance rate {self.accepted / self.drafted:.0%} ({self.accepted} of {self.drafted} drafts), "
               if self.drafted else "")
            + f"finish reason {self.finish_reason}]"
        )


def prompt_token_ids(engine: Engine, prompt: str | list[dict[str, str]]) -> list[int]:
    """The prompt's token ids: text through the model's tokenizer, or for a model without one,
    token ids written out ("1,2,3" or "1 2 3"); a chat's messages through the model's chat template
    (`mla_func.serving.requests.chat_token_ids`). ValueError naming the prompt otherwise."""
    if not isinstance(prompt, str):
        return list(chat_token_ids(None, prompt, engine.limits))
    tokenizer = engine.model.tokenizer
    if tokenizer is not None:
        return list(tokenizer.encode(prompt).ids)
    try:
        return [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        raise ValueError(
            f"prompt: model {engine.model.config.model_type} has no tokenizer.json; give the prompt as token ids "
            f"such as '1 2 3', got {prompt[:40]!r}"
        ) from None


def length_note(engine: Engine, prompt_tokens: int, params: SamplingParams) -> str | None:
    """The note for a --max-tokens past the model's maximum length, which the engine cuts to what fits
    (a prompt too long for even one token is the engine's error, not a cut)."""
    max_len = engine.config.max_model_len
    room = max_len - prompt_tokens
    if not 0 < room < params.max_tokens:
        return None
    return (f"note: --max-tokens {params.max_tokens} cut to {room}: the model's maximum length is {max_len} "
            f"and the prompt has {prompt_tokens} tokens")


def stream_completion(engine: Engine, prompt: str | list[dict[str, str]], params: SamplingParams, *, out: TextIO,
                      err: TextIO) -> int:
    """Generate one completion of `prompt` (text, or a chat's messages), writing its text to `out` as it comes
    and a summary to `err`.

    Returns the exit status: 0, 2 when the request is refused (the reason on
    `err`), or 130 when interrupted by Ctrl-C (after the summary of what was generated).
    A `params.max_tokens` past the model's maximum length is cut with a note on `err`; the
    summary shows `params.seed` unless decoding is greedy, where the seed plays no part.
    """
    ids = prompt_token_ids(engine, prompt)
    note = length_note(engine, len(ids), params)
    if note is not None:
        print(note, file=err, flush=True)
    tokenizer = engine.model.tokenizer
    decoder = DecodeStream(skip_special_tokens=True)
    started = time.perf_counter()
    first_token_at: float | None = None
    generated = 0
    finish_reason = "none"
    status = 0
    completions: dict[int, Completion] = {}  # by choice: what follows the streamed sample
    try:
        for event in engine.generate_stream([ids], params):
            if event.completion is not None and event.completion.error is not None:
                print(f"error: {event.completion.error}", file=err)
                return EXIT_ERROR
            if event.completion is not None:
                completions[event.choice] = event.completion
            if event.choice != 0:
                continue  # --n: the other samples are printed whole after the first
            if first_token_at is None:
                first_token_at = time.perf_counter()
            generated += 1
            if event.text is not None:
                # A request with --stop: the engine's own text, which holds back what could begin a
                # stop string and never passes one.
                out.write(event.text)
            elif tokenizer is not None:
                piece = decoder.step(tokenizer, event.token_id)
                if piece is not None:
                    out.write(piece)
            else:
                out.write(f"{event.token_id} ")
            out.flush()
            if event.completion is not None:
                finish_reason = event.completion.finish_reason
    except KeyboardInterrupt:
        finish_reason, status = "interrupted", EXIT_INTERRUPTED
    finished = time.perf_counter()
    print(file=out, flush=True)
    if status == 0:
        write_after_text(engine, completions, params, out)
    drafts = engine.speculative_stats
    stats = StreamStats(len(ids), generated, started, first_token_at, finished, finish_reason, drafts.drafted,
                        drafts.accepted, seed=None if params.greedy else params.seed)
    print(stats.summary(), file=err, flush=True)
    return status


def write_after_text(engine: Engine, completions: dict[int, Completion], params: SamplingParams, out: TextIO) -> None:
    """What follows the streamed text: with `--n`, each other sample's text under a header; with
    `--logprobs` / `--prompt-logprobs`, a line per token: the token, its logprob, its likeliest alternatives."""
    for choice in sorted(completions):
        completion = completions[choice]
        if choice:
            print(f"--- sample {choice + 1} of {params.n} ---", file=out)
            print(_text(engine, completion.token_ids) if completion.text is None else completion.text, file=out)
        if completion.prompt_logprobs is not None and choice == 0:  # the same for every sample
            print("--- prompt logprobs ---", file=out)
            for token, entry in zip(completion.prompt_token_ids, completion.prompt_logprobs):
                print(_logprob_line(engine, token, entry), file=out)
        if completion.logprobs is not None:
            print(f"--- logprobs{'' if params.n == 1 else f' of sample {choice + 1}'} ---", file=out)
            for token, entry in zip(completion.token_ids, completion.logprobs):
                print(_logprob_line(engine, token, entry), file=out)
    out.flush()


def _text(engine: Engine, token_ids: tuple[int, ...]) -> str:
    tokenizer = engine.model.tokenizer
    return tokenizer.decode(list(token_ids)) if tokenizer is not None else " ".join(map(str, token_ids))


def _logprob_line(engine: Engine, token: int, entry: TokenLogprob | None) -> str:
    """`'piece' -0.1234  'a' -0.1, 'b' -2.3` (a prompt's first token, which has none: `'piece' -`)."""
    if entry is None:
        return f"{_text(engine, (token,))!r} -"
    alternatives = ", ".join(f"{_text(engine, (t,))!r} {v:.4f}" for t, v in entry.top.items())
    return f"{_text(engine, (token,))!r} {entry.logprob:.4f}" + (f"  {alternatives}" if alternatives else "")
