"""Drawing a step's tokens: the one packing of requests' settings into the sampler.

Every place that turns logits rows into tokens (a plain step's rows, a verify step's rows, the
drafter's chain and catch-up) lists the rows it draws with `DrawRows` and calls `draw_tokens`:
each row gets its request's penalties (when asked), temperature, top-k, top-p, its seed and the
key position of the token it draws, so a row's token is the same function of its logits
wherever it is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mla_func.kernels import Ops
from mla_func.serving.penalties import adjust_logits
from mla_func.serving.requests import CheckedRequest, LiveRequest
from mla_func.serving.sampling import sample

__all__ = ["DrawRows", "draw_tokens", "draw_tokens_with_logprobs"]


@dataclass(slots=True)
class DrawRows:
    """The rows to draw a token from, in order: each one's logits row index, request, context (the
    tokens penalties count), seed and key position (the index the drawn token will have).
    plain: every row's request is `CheckedRequest.plain` (its token is its row's argmax)."""

    index: list[int] = field(default_factory=list)
    requests: list[CheckedRequest] = field(default_factory=list)
    contexts: list[list[int]] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    plain: bool = True

    def add(self, index: int, live: LiveRequest, context: list[int], position: int) -> None:
        """Row `index` of the logits, drawn for `live`'s request with its seed at key `position`;
        `context` is what its penalties count (its output so far, and any drafts before the row)."""
        self.index.append(index)
        self.requests.append(live.request)
        self.contexts.append(context)
        self.seeds.append(live.seed)
        self.positions.append(position)
        self.plain = self.plain and live.request.plain

    @classmethod
    def of(cls, lives: list[LiveRequest], positions: list[int]) -> DrawRows:
        """Logits rows 0..M-1, row i drawn for lives[i] at key positions[i], its context its output so far:
        a plain step's rows, listed in one pass per field (the engine's host loop builds this every step)."""
        requests = [live.request for live in lives]
        return cls(list(range(len(lives))), requests, [live.output_token_ids for live in lives],
                   [live.seed for live in lives], positions, all(r.plain for r in requests))


def draw_tokens(logits: torch.Tensor, rows: DrawRows, *, penalties: bool, ops: Ops) -> torch.Tensor:
    """[M] int64 tokens of logits[rows.index] ([N, V]), each drawn with its request's settings and key
    by `ops`' sampling op; `penalties` applies each request's penalties and min_tokens first."""
    if not rows.index:
        return torch.zeros(0, dtype=torch.int64, device=logits.device)
    if rows.plain:
        # Greedy rows with nothing to adjust: the argmax of the raw rows, without the per-request walks.
        return _picked(logits, rows, penalties=False).argmax(dim=-1)
    return _draw(_picked(logits, rows, penalties), rows, ops)


def draw_tokens_with_logprobs(logits: torch.Tensor, rows: DrawRows, *, penalties: bool, ops: Ops,
                              top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draw_tokens`, with the logprobs of the rows the tokens are drawn from, all on the device.

    Returns (tokens [M] int64, logprobs [M, top + 1] float32, top_ids [M, top] int64): logprobs[:, 0]
    is each drawn token's, logprobs[:, 1:] those of its row's `top` most likely tokens (top_ids),
    in descending order. They are `log_softmax` in float32 of the very rows drawn from, after
    penalties and min_tokens but before temperature, top-k and top-p: the model's distribution,
    as OpenAI's logprobs are, so they do not change with the sampling settings.
    """
    picked = _picked(logits, rows, penalties)  # [M, V]
    tokens = _draw(picked, rows, ops)
    logprobs = torch.log_softmax(picked.float(), dim=-1)  # [M, V]
    best, top_ids = logprobs.topk(top, dim=-1)  # [M, top], sorted descending
    return tokens, torch.cat([logprobs.gather(1, tokens[:, None]), best], dim=1), top_ids


def _picked(logits: torch.Tensor, rows: DrawRows, penalties: bool) -> torch.Tensor:
    """[M, V]: logits[rows.index], with the requests' penalties and min_tokens when `penalties`."""
    identity = rows.index == list(range(logits.shape[0]))
    picked = logits if identity else logits.index_select(0, torch.tensor(rows.index, device=logits.device))
    return adjust_logits(picked, rows.requests, rows.contexts) if penalties else picked


def _draw(picked: torch.Tensor, rows: DrawRows, ops: Ops) -> torch.Tensor:
    """[M] int64 tokens of the rows `picked` ([M, V]), each with its request's settings and key."""
    device = picked.device
    reqs = rows.requests
    if all(r.params.greedy for r in reqs):
        # Greedy rows need no noise: skip the [M, V] draw (a host-side fact, so no sync).
        return picked.argmax(dim=-1)
    vocab = picked.shape[-1]
    return sample(
        picked,
        # 0 for greedy rows, so the device decides exactly as `SamplingParams.greedy` did.
        temperature=torch.tensor([0.0 if r.params.greedy else r.params.temperature for r in reqs], device=device),
        top_k=torch.tensor([min(r.params.top_k, vocab) for r in reqs], device=device),
        top_p=torch.tensor([r.params.top_p for r in reqs], device=device),
        seeds=torch.tensor(rows.seeds, dtype=torch.int64, device=device),
        positions=torch.tensor(rows.positions, dtype=torch.int64, device=device),
        use_top_k_top_p=any(r.params.top_k or r.params.top_p < 1 for r in reqs),
        ops=ops,
    )
