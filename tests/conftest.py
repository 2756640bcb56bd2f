"""Test set-up shared by every test module.

Without CUDA, Triton kernels run in the interpreter: the variable has to be set
before triton is first imported, which this file (loaded before any test module)
guarantees.

Triton's CPU interpreter (3.9 at least) gets bfloat16 wrong in two ways that
compiled kernels do not:
* `tl.dot` multiplies bf16 operands as the raw uint16 bit patterns it stores
  them in, so every bf16 dot comes out as garbage;
* float32 -> bf16 casts truncate instead of rounding to nearest even.
and a third way on some CPUs:
* `tl.dot` is numpy's matmul, whose BLAS kernels sum a row's products in an order that
  follows the row's place in the tile on some CPUs (OpenBLAS's AVX2 kernels; AVX-512 machines
  did not show it), so a row's bits would follow its batch-mates where a GPU's would not.
The patches below widen bf16 dot operands to float32 first (exact, as a tensor
core does) and round casts to nearest even (as the GPU does). Tests marked
`row_invariant_dots` (those asserting that a Triton kernel's rows keep their bits
whatever their batch-mates) also get a dot that multiplies each row by itself (a
batch of one-row products: every row through one kernel in one order); it costs
1.3-2.3x numpy's matmul, so the other tests keep that. The patches apply only when
the interpreter is active.

The interpreter also re-patches `triton.language` on every call of a device function
(every `tl.sum`, `tl.max`, `tl.sigmoid` and helper of ours): it lists each language
module's members with `inspect.getmembers` and patches those still builtin, about 2 ms
a call. `_list_builtins_once` keeps the listing: the names of each module's builtins
are read once, and each call patches those of them still builtin, the attributes the
interpreter's own listing would give (after the launch's patch, none), so the kernels
run exactly as before: a kernel of one `tl.sum` 2.3x faster a program, the test running
`v4-tiny` on the Triton table 10% (75 s -> 67 s). A module's builtins are patched and put
back all at once, so when its first one is patched already the call has nothing to do.

Two more of the interpreter's costs do not change what a kernel computes:
* it checks every int32 add, subtract and multiply for overflow (in int64, with a device
  assert), a check compiled kernels make only in debug builds; at the tests' sizes no index
  comes near 2^31 (the whole suite passed with the check on, 0c92fef), and it took a third of
  the interpreter's time. `_interpreter_options` turns it off; offsets at real sizes are the GPU
  tests' to check.
* it rebuilds a table of 19 numpy dtypes at every dtype lookup; `_memoize_np_dtypes` keeps the
  answers (a dtype's numpy storage type never changes).

Under pytest-xdist every worker is a process of its own, and torch would give each as many
threads as the machine has cores: on a 2-core machine with 2 workers, 4 busy threads fight
over 2 cores and OpenMP's spinning threads slow small ops by orders of magnitude. Each worker
therefore takes its share of the cores, and keeps it: the command line's in-process tests set
their own thread count (`--threads`, 1 on the CPU by default), which is put back after each test.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, (os.cpu_count() or 1) // _WORKERS) if _WORKERS > 1 else torch.get_num_threads()
torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True)
def _worker_threads():
    """Each test starts with the worker's share of the cores, whatever the previous one set, and ends
    with nothing frozen out of the garbage collector (`Engine.warmup` freezes what is alive)."""
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
    yield
    gc.unfreeze()


def _patch_interpreter_bf16() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_widens_bf16", False):
        return
    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
            # NaN stays NaN (rounding could carry a NaN payload into infinity).
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original_cast(self, src, dst_type)

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            data = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._widens_bf16 = True
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl


def _list_builtins_once() -> None:
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._patch_builtin, "_lists_once", False):
        return
    builtin_names: dict[int, list[str]] = {}

    def patch_builtin(pkg, builder, scope):
        names = builtin_names.get(id(pkg))
        if names is None:
            # The first listing is the launch's, made before anything is patched.
            names = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
            builtin_names[id(pkg)] = names
        # A module's builtins are patched together and put back together (one scope), so its first
        # builtin tells whether the rest are still to patch.
        if names and not tl.core.is_builtin(getattr(pkg, names[0])):
            return
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin._lists_once = True
    interpreter._patch_builtin = patch_builtin


def _interpreter_options() -> None:
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _memoize_np_dtypes() -> None:
    from triton.runtime import interpreter

    # Called once, at this module's import (one per process).
    original = interpreter._get_np_dtype
    answers: dict[str, np.dtype] = {}

    def get_np_dtype(tt_dtype):
        # A dtype's str names it whole (pointer, block and element types alike).
        key = str(tt_dtype)
        answer = answers.get(key)
        if answer is None:
            answer = answers[key] = original(tt_dtype)
        return answer

    interpreter._get_np_dtype = get_np_dtype


def _row_by_row_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's dot (bf16 widened as above) as one product [1, K] @ [K, N] a row of a: one order for
    every row, wherever it sits in the tile. FP8 operands widen to fp16 first, as the interpreter's own dot does."""
    import triton.language as tl
    from triton.runtime import interpreter

    def widened(h):
        if h.dtype.scalar == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32), tl.float32
        return h.data, h.dtype.scalar

    (a_data, a_type), (b_data, b_type) = widened(a), widened(b)
    if any(t.primitive_bitwidth == 8 and t.is_floating() for t in (a_type, b_type)):
        a_data = interpreter._convert_float(a_data, a_type, tl.float16, None).view(np.float16)
        b_data = interpreter._convert_float(b_data, b_type, tl.float16, None).view(np.float16)
    rows = np.matmul(a_data[..., :, None, :], np.expand_dims(b_data, -3), dtype=d.data.dtype)[..., 0, :]
    return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)


@pytest.fixture(autouse=True)
def _row_invariant_dots(request, monkeypatch):
    """Under the interpreter, tests marked `row_invariant_dots` run with `_row_by_row_dot`."""
    if os.environ.get("TRITON_INTERPRET") == "1" and request.node.get_closest_marker("row_invariant_dots"):
        from triton.runtime import interpreter

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _row_by_row_dot)
    yield


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16()
    _list_builtins_once()
    _interpreter_options()
    _memoize_np_dtypes()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
