"""Stop strings that span a token boundary, and where a completion must be cut at one."""

from __future__ import annotations


def spanning_stop(model, token_ids, rng):
    """A substring of the decoded tokens that spans a token boundary, and where it must cut:
    (stop string, text before it, tokens up to the one that completes it)."""
    tok = model.tokenizer
    ends = [len(tok.decode(list(token_ids[:i]))) for i in range(len(token_ids) + 1)]
    text = tok.decode(list(token_ids))
    candidates = []
    for i in range(1, len(token_ids) - 1):
        # Start inside token i (or at its start), end inside a later token.
        for start in range(ends[i], ends[i + 1]):
            for end in range(ends[i + 1] + 1, min(ends[-1], start + 8) + 1):
                stop = text[start:end]
                if text.find(stop) == start and stop.strip():  # its first occurrence, so the cut is here
                    candidates.append((stop, start, end))
    stop, start, end = rng.choice(candidates)
    n = next(k for k in range(len(ends)) if ends[k] >= end)
    return stop, text[:start], tuple(token_ids[:n])
