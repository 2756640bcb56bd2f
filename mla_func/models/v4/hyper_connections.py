"""Manifold-constrained hyper-connections (mHC): N residual streams instead of one.

Each token carries N = hc_mult streams [T, N, D]. At each sublayer (attention,
then the MoE) one mHC site computes, from all streams of a token:

* pre  [T, N]: the weights that collapse the streams into the sublayer's input;
* post [T, N]: how the sublayer's output is written back into each stream;
* comb [T, N, N]: how the streams mix, projected by Sinkhorn-Knopp iterations
  onto (nearly) doubly-stochastic matrices so the mixing cannot blow up.

new streams[k] = post[k] * sublayer(collapse) + sum_j comb[j, k] * streams[j].
The weights are computed in float32 from the RMS-normalised flattened streams.
The sites, write-backs and the hyper head are ops of the `v4` group (`hc_site`,
`hc_write_back`, `hc_write_back_site`, `hc_head`): a write-back is always followed by the next site, so the
two run as one op, and a layer hands the next one the streams still to be
written back (`HyperResidual`) rather than the written ones.
At the end of the model, the hyper head collapses the streams once more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HyperResidual:
    """A sublayer's write-back not yet applied: the streams it goes into and its weights (with the
    sublayer's output out [T, D], the new streams are `ops.v4.hc_write_back(post, comb, out, streams)`)."""

    streams: torch.Tensor  # [T, N, D]
    post: torch.Tensor     # [T, N] float32
    comb: torch.Tensor     # [T, N, N] float32
