"""Random inputs and tolerances shared by the kernel tests.

Every Triton result is compared with the torch reference evaluated in float64
on the *same* (already rounded) inputs, so the tolerance only has to cover the
kernel's own rounding: its output dtype and, for bf16/fp16, intermediates it
keeps in that dtype (probabilities fed to the value product, decompressed keys).
"""

from __future__ import annotations

import torch

TOLERANCE = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
LSE_TOLERANCE = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def w8a8_tolerance(dtype, w8a8: bool, device: torch.device) -> dict:
    """The tolerance of an FP8 product's output: TOLERANCE's, but for w8a8 into float32 on a GPU, whose FP8 x
    FP8 tensor-core products accumulate a scale block with fewer mantissa bits than float32 (Hopper's FP8
    MMA: an H100 was 1.1e-3 off at most, outputs near 1); the interpreter computes them exactly."""
    if w8a8 and dtype == torch.float32 and device.type == "cuda":
        return {torch.float32: dict(atol=2e-3, rtol=2e-3)}
    return TOLERANCE


def generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def strided(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A copy of `t` with the same values but a non-contiguous layout (every dim padded)."""
    big = torch.randn([2 * s + 1 for s in t.shape], generator=gen, device=t.device).to(t.dtype)
    view = big[tuple(slice(1, 2 * s + 1, 2) for s in t.shape)]
    view.copy_(t)
    assert not view.is_contiguous() or t.numel() <= 1
    return view


def paged_cache(seq_lens: list[int], block_size: int, dim: int, dtype, device, gen,
                spare_width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache and a block table of distinct pages (block 0 is never handed out).

    Every table entry points at a real page, also past a sequence's length, so a
    kernel that reads beyond seq_lens reads finite garbage and gets caught by the
    comparison rather than by a fault.
    """
    width = max(1, max((-(-n // block_size) for n in seq_lens), default=1)) + spare_width
    num_blocks = 1 + len(seq_lens) * width + 3
    kv_cache = randn((num_blocks, block_size, dim), dtype, device, gen)
    pages = torch.randperm(num_blocks - 1, generator=gen, device=device)[: len(seq_lens) * width] + 1
    return kv_cache, pages.view(len(seq_lens), width).to(torch.int32)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype, table=TOLERANCE) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **table[dtype])


def captured(step):
    """`step()` run once eagerly (compiling its kernels), then captured: (the CUDA graph, the outputs its
    replays write)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
