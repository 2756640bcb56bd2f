"""What the GPU a kernel runs on offers, where that chooses between kernels: a module of its own, so that the
Triton and Gluon packages do not import each other for it."""

from __future__ import annotations

import torch


def hopper(device: torch.device) -> bool:
    """Whether `device` is an NVIDIA Hopper GPU (compute capability 9.x): the warpgroup MMA that the Gluon
    kernels take and the TMA that the FP8 weight stream takes (Blackwell dropped the warpgroup MMA, and its TMA
    is not measured here; ROCm's gfx9 GPUs report a 9.x capability too)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9


def e4m3_pairs_to_fp16(device: torch.device) -> bool:
    """Whether `device` widens two e4m3 bytes to two fp16 values in one instruction (`cvt.rn.f16x2.e4m3x2`, which
    the FP4 widening's inline PTX takes: NVIDIA compute capability 8.9 and later)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)
