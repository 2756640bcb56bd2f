"""Zero-filled buffers from a Triton kernel, so that they join a chain of programmatic dependents.

A buffer that a kernel accumulates into (atomics, arrival counters) must be
zeroed just before it. `torch.zeros` does that with its own fill kernel, which
cannot launch before the kernel ahead of it ends, nor let the next one launch
early; this fill waits and releases like the decode-path kernels (see
`_common.pdl`), so the chain keeps its overlap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import pdl

_BLOCK = 1024


@triton.jit
def _zero_kernel(out_ptr, numel, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        # The buffer may reuse memory an earlier kernel still reads: write after the wait.
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=offs < numel)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous tensor of `shape` and `dtype` on `device`, all zeros."""
    out = torch.empty(shape, dtype=dtype, device=device)
    numel = out.numel()
    if numel:
        use_pdl = pdl(device)
        _zero_kernel[(triton.cdiv(numel, _BLOCK),)](out, numel, BLOCK=_BLOCK, GDC=use_pdl,
                                                     num_warps=4, launch_pdl=use_pdl)
    return out
