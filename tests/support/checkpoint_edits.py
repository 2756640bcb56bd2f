"""Helpers for checkpoint tests: edit a saved checkpoint, bound a call's time, record the files it opens."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import load_file, save_file

# The lists that `recording_opens` fills; the audit hook (installed once: hooks
# cannot be removed) appends to the innermost.
_RECORDERS: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
    # "open" is raised by builtins.open, io.open and os.open alike, whatever module calls them.
    if event == "open" and _RECORDERS and isinstance(args[0], (str, bytes, os.PathLike)):
        _RECORDERS[-1].append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


@contextmanager
def recording_opens() -> Iterator[list[str]]:
    """The absolute paths of every file opened inside the block (file descriptors excepted)."""
    opened: list[str] = []
    _RECORDERS.append(opened)
    try:
        yield opened
    finally:
        _RECORDERS.pop()


# Files the loader reads that no checkpoint chooses: the free-memory reading before params are allocated.
SYSTEM_FILES = frozenset({"/proc/meminfo"})


def outside(paths: list[str], folder: Path) -> list[str]:
    """The paths that do not resolve to a file inside `folder` (the loader's own SYSTEM_FILES aside)."""
    root = folder.resolve()
    return [p for p in paths if p not in SYSTEM_FILES and not Path(os.path.realpath(p)).is_relative_to(root)]


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the block after `seconds` (a blocked open(2) included: the signal interrupts it)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def edit_tensors(path: Path, edit, file: str = "model.safetensors") -> None:
    tensors = load_file(path / file)
    edit(tensors)
    save_file(tensors, path / file, metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
