"""Programmatic dependent launch from Gluon kernels: the two PTX instructions, as the `tl` kernels' `gdc_*`.

A kernel launched with `launch_pdl=True` may start while the kernel before it still runs: `gdc_wait` holds
it until that kernel's memory is visible (call it before reading anything the kernel before may write),
and `gdc_launch_dependents` lets the kernel after this one start its own programs.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
