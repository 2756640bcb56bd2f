"""Repetition / presence / frequency penalties and `min_tokens`, applied to one step's logits on the device.

Every adjustment of a row reads only that row's logits, its own tokens and its
own settings, so a seeded request samples the same tokens whatever its
batch-mates. The host already knows each request's tokens (they came back from
earlier steps); it sends them as one flat list of (row, token id) pairs, and the
device does the counting, so no step waits on the device for anything new.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mla_func.serving.requests import CheckedRequest


def penalize(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits, as in transformers (repetition) and OpenAI's API (presence, frequency).

    logits     [N, V] float32
    seen       [N, V] bool: the token is in the row's prompt or output
    counts     [N, V] float32: how many times the token is in the row's output
    repetition [N] > 0 (1 = off); presence, frequency [N] (0 = off)
    returns    [N, V] float32: where seen, a positive logit is divided by the
               repetition penalty and a negative one multiplied by it; then
               frequency * count + presence * (count > 0) is subtracted.
    """
    r = repetition[:, None]
    repeated = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, repeated, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()


def ban(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with -inf at each (rows[i], token_ids[i]); rows, token_ids [M] int64."""
    return logits.index_put((rows, token_ids), torch.tensor(-math.inf, device=logits.device))


def _pairs(lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[M] row indices and [M] token ids of the (row, token) pairs of `lists` (one list per row)."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    flat = [t for ids in lists for t in ids]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(flat, dtype=torch.int64, device=device))


def adjust_logits(
    logits: torch.Tensor, requests: Sequence[CheckedRequest], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """The logits [N, V] of N rows, one per request, with its penalties and min_tokens applied.

    outputs: the tokens each request has generated so far (host lists). Returns
    `logits` itself when no row asks for anything; float32 otherwise.
    """
    penalised = [r.params.penalised for r in requests]
    banned = [r.stop_token_ids if len(out) < r.params.min_tokens else () for r, out in zip(requests, outputs)]
    if not any(penalised) and not any(banned):
        return logits
    logits = logits.float()
    device = logits.device
    if any(penalised):
        n, vocab = logits.shape
        out_rows, out_ids = _pairs([out if p else () for out, p in zip(outputs, penalised)], device)
        counts = torch.zeros(n, vocab, device=device).index_put_(
            (out_rows, out_ids), torch.ones((), device=device), accumulate=True
        )
        prompt_rows, prompt_ids = _pairs([r.prompt_token_ids if p else () for r, p in zip(requests, penalised)], device)
        seen = (counts > 0).index_put_((prompt_rows, prompt_ids), torch.tensor(True, device=device))
        logits = penalize(
            logits, seen, counts,
            repetition=torch.tensor([r.params.repetition_penalty for r in requests], device=device),
            presence=torch.tensor([r.params.presence_penalty for r in requests], device=device),
            frequency=torch.tensor([r.params.frequency_penalty for r in requests], device=device),
        )
    if any(banned):
        logits = ban(logits, *_pairs(banned, device))
    return logits
