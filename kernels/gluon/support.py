"""Where the Gluon kernels run: a Hopper GPU (the warpgroup MMA), under the Triton release they are written for.

Gluon is experimental and its language moves between Triton releases (3.9 renamed `thread_barrier` to
`barrier`, for one). These kernels are written against, compiled by and checked on the GPU with Triton 3.6
(`GLUON_RELEASES`); under any other release `available` says no and their `tl.dot` twins run, slower but
never a kernel that fails to compile in the middle of a step.
"""

from __future__ import annotations

import re

import torch
import triton

from ..hardware import hopper

# The Triton releases (major, minor) whose Gluon the kernels are written and checked against.
GLUON_RELEASES = ((3, 6),)


def triton_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a Triton version string ("3.6.0", "3.6.0+git1a2b3c"; default: the installed one)."""
    text = triton.__version__ if version is None else version
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"triton version: expected 'major.minor...', got {text!r}")
    return int(found.group(1)), int(found.group(2))


def available(device: torch.device) -> bool:
    """Whether the Gluon kernels run on `device`: a Hopper GPU (`hardware.hopper`) and an installed Triton in
    GLUON_RELEASES."""
    return hopper(device) and triton_release() in GLUON_RELEASES
