"""The mla-func command run as a user runs it: a subprocess, on the CPU path unless told otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, as on a fresh machine


def mla_func(*args: str, timeout: int = 240, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("mla-func")
    command = [exe] if exe else [sys.executable, "-m", "mla_func.cli.commands"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=env or ENV,
                          input=stdin if stdin is not None else "")
