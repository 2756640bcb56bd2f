"""Manifold-constrained hyper-connections (mHC): N residual streams instead of one.

Each token carries N = hc_mult streams [T, N, D]. At each sublayer (attention,
then the MoE) one mHC site computes, from all streams of a token:

* pre  [T, N]: the weights that collapse the streams into the sublayer's input;
* post [T, N]: how the sublayer's output is written back into each stream;
* comb [T, N, N]: how the streams mix, projected by Sinkhorn-Knopp iterations
  onto (nearly) doubly-stochastic matrices so the mixing cannot blow up.

new streams[k] = post[k] * sublayer(collapse) + sum_j comb[j, k] * streams[j].
The weights are computed in float32 from the RMS-normalised flattened streams.
At the end of the model, the hyper head collapses the streams once more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import Ops
from .v4_params import HyperConnectionParams, HyperHeadParams


def hc_weights(p: HyperConnectionParams, streams: torch.Tensor, ops: Ops, *, iters: int, hc_eps: float,
               norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D] -> (pre [T, N], post [T, N], comb [T, N, N]), all float32."""
    flat = ops.v4.unit_rms(streams.flatten(1).float(), norm_eps)
    mixes = F.linear(flat, p.fn.float())                                  # [T, (2 + N) * N]
    return ops.v4.hc_mix_weights(mixes, p.base, p.scale, hc_mult=streams.shape[1], iters=iters, hc_eps=hc_eps)


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_n pre[t, n] * streams[t, n] -> [T, D] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The write-back of a sublayer's output out [T, D] as (delta, residual), both [T, N, D].

    delta = post[:, k] * out (the sublayer's share of stream k) and residual = comb^T @ streams
    (the mixed streams); the new streams are residual + delta.
    """
    dtype = streams.dtype
    delta = post.to(dtype).unsqueeze(-1) * out.to(dtype).unsqueeze(-2)
    residual = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return delta, residual


def hyper_head(p: HyperHeadParams, streams: torch.Tensor, ops: Ops, *, hc_eps: float, norm_eps: float
               ) -> torch.Tensor:
    """The model's last collapse: streams [T, N, D] -> [T, D] with weights from all streams (float32)."""
    flat = ops.v4.unit_rms(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, p.fn.float()) * p.scale.float() + p.base.float()) + hc_eps
    return collapse(pre, streams)
