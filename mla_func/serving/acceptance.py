"""Which drafts a verify step accepts: a pure function of the target's tokens and the drafts.

A verify row j of a sequence (position c + j) holds the target's logits for the token
at c + j + 1 given the last token and drafts d_1..d_j. Every row's token is drawn as a
request's tokens always are (`sampling.sample`: the argmax for greedy requests, else a
Gumbel-max draw keyed by (seed, token position), after its penalties, temperature,
top-k and top-p), and the drafts were drawn from the drafter's logits with the same
key. Draft d_{j+1} is accepted while every earlier one was and it equals row j's token;
the tokens kept are the rows' tokens up to and including the first row whose draft is
rejected (or the last row).

This keeps the target distribution exactly, whatever the drafter: a kept row's context
is the one plain decoding would have had, and its token is the one plain decoding
would have drawn with that key. So a request's tokens are those of decoding without
drafts: they depend neither on k nor on the drafts, and (as the logits allow; README
"Batch invariance") not on the batch-mates. Sharing the key couples drafter and target
(Gumbel-max coupling): when their distributions agree, so do their draws; the chance
that a draft is accepted is at least (1 - TV) / (1 + TV) for the total variation
distance TV between the two distributions, against 1 - TV for the rejection rule of
Leviathan et al. and Chen et al., whose tokens depend on the drafts.
"""

from __future__ import annotations

import torch


def accepted_lengths(target_tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """How many drafts each sequence accepts: the longest prefix where draft j equals row j - 1's token.

    target_tokens [B, q] int64 the token drawn from each verify row; drafts [B, q - 1] int64
    returns [B] int64 in [0, q - 1]; the sequence keeps target_tokens[b, : accepted[b] + 1].
    """
    if target_tokens.dim() != 2 or drafts.shape != (target_tokens.shape[0], target_tokens.shape[1] - 1):
        raise ValueError(f"accepted_lengths: expected target_tokens [B, q] and drafts [B, q - 1], got "
                         f"{tuple(target_tokens.shape)} and {tuple(drafts.shape)}")
    match = (drafts == target_tokens[:, :-1]).to(torch.int64)           # [B, q - 1]
    return match.cumprod(dim=1).sum(dim=1)
