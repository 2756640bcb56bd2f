"""DeepSeek-V4's hyper-connection weights from the mixing logits, in plain torch."""

from __future__ import annotations

import torch


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., N, N] positive -> columns, then rows and columns `iters - 1` more times, normalised to sum 1."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mix_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_mult: int, iters: int,
                   hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site's weights from its mixing logits.

    mixes [T, (2 + N) * N] float32 (pre | post | comb logits, N = hc_mult); base [(2 + N) * N]; scale [3]
    -> pre [T, N] = sigmoid(s0 * pre + b) + eps, post [T, N] = 2 sigmoid(s1 * post + b),
       comb [T, N, N] = Sinkhorn(softmax_rows(s2 * comb + b) + eps, iters), all float32.
    """
    n = hc_mult
    pre_w, post_w, comb_w = mixes.float().split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s[2] + comb_b.view(n, n), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)
