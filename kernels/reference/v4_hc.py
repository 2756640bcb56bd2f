"""DeepSeek-V4's hyper-connections in plain torch: the weights from the mixing logits, and whole mHC sites.

A site reads a token's N streams [N, D] and gives the sublayer's input (the streams
collapsed by `pre`, then RMS-normalised with the site's norm weight) and the weights
of the write-back (`post`, `comb`); a write-back mixes the streams by comb^T and adds
post ⊗ the sublayer's output. `hc_site` and `hc_write_back_site` are these steps
composed of torch ops in the order the model has always run them, so the torch
backend's numerics are those of the unfused model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import rms_norm
from .v4_attention import unit_rms


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


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_n pre[t, n] * streams[t, n] (pre [T, N] float32, streams [T, N, D]) -> [T, D] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The write-back of a sublayer's output out [T, D] as (delta, residual), both [T, N, D] in the streams' dtype.

    delta = post[:, k] * out (the sublayer's share of stream k) and residual = comb^T @ streams
    (the mixed streams: residual[:, k] = sum_j comb[:, j, k] * streams[:, j]); the new streams
    are residual + delta.
    """
    dtype = streams.dtype
    delta = post.to(dtype).unsqueeze(-1) * out.to(dtype).unsqueeze(-2)
    residual = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return delta, residual


def hc_write_back(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """post [T, N], comb [T, N, N] float32; out [T, D]; streams [T, N, D] -> the new streams [T, N, D]
    = comb^T @ streams + post ⊗ out, each term and the sum rounded to the streams' dtype."""
    delta, residual = expand(post, comb, out, streams)
    return residual + delta


def hc_site(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            norm_weight: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site: streams [T, N, D]; fn [(2 + N) * N, N * D] float32; base [(2 + N) * N]; scale [3];
    norm_weight [D] -> (x [T, D], post [T, N], comb [T, N, N] float32).

    mixes = unit_rms(streams flattened to [T, N * D] in float32) @ fn^T give pre, post and comb
    (`hc_mix_weights`); x = rms_norm(collapse(pre, streams), norm_weight) in promote(norm_weight,
    streams) dtype; both norms take norm_eps.
    """
    flat = unit_rms(streams.flatten(1).float(), norm_eps)
    mixes = F.linear(flat, fn.float())                                    # [T, (2 + N) * N]
    pre, post, comb = hc_mix_weights(mixes, base, scale, hc_mult=streams.shape[1], iters=iters, hc_eps=hc_eps)
    return rms_norm(collapse(pre, streams), norm_weight, norm_eps), post, comb


def hc_write_back_site(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor,
                       fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *,
                       iters: int, hc_eps: float, norm_eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_write_back` of out [T, D] into streams [T, N, D], then `hc_site` of the new streams with the next
    site's fn, base, scale and norm_weight -> (new streams [T, N, D], x [T, D], post [T, N], comb [T, N, N])."""
    new = hc_write_back(post, comb, out, streams)
    x, post, comb = hc_site(new, fn, base, scale, norm_weight, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    return new, x, post, comb


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """The model's hyper head, its last collapse: streams [T, N, D]; fn [N, N * D], base [N], scale [1] float32
    -> collapse(sigmoid(scale * (unit_rms(streams flattened, float32) @ fn^T) + base) + hc_eps, streams) [T, D]."""
    flat = unit_rms(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return collapse(pre, streams)
