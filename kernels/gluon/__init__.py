"""GPU-only kernels in Triton's Gluon: Hopper's warpgroup MMA (`wgmma`) and asynchronous copies, where
`tl.dot` stops short of a target.

Each kernel here has a `tl.dot` twin in `kernels/triton` with the same contract: the twin is what the
CPU interpreter checks and what GPUs without the feature run; the Triton table takes the Gluon kernel
only where `available` says the device (and the installed Triton: `support`) has it. GPU tests compare the
two and the reference. Written against Triton 3.6's Gluon; nothing here is compiled until a CUDA device
calls it.
"""

from __future__ import annotations

from .mla_decode import applies, copyable, wgmma_sparse_split_decode, wgmma_split_decode
from .support import available

__all__ = ["applies", "available", "copyable", "wgmma_sparse_split_decode", "wgmma_split_decode"]
