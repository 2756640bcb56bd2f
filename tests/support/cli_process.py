"""The mla-func command run as a user runs it: a subprocess, on the CPU path unless told otherwise; and, for
commands that end before a model loads, `cli.main` in the test's own process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import mla_func.cli.commands as cli

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, as on a fresh machine


def installed_script() -> Path | None:
    """The `mla-func` script the test interpreter's environment installed (its scripts folder, whether or not
    it is on PATH), or None."""
    script = Path(sysconfig.get_path("scripts")) / "mla-func"
    return script if script.is_file() else None


def mla_func_command() -> list[str]:
    """The command a user types: the environment's `mla-func` script, else one on PATH, else
    `python -m mla_func.cli` (a source tree on PYTHONPATH)."""
    exe = installed_script() or shutil.which("mla-func")
    return [str(exe)] if exe else [sys.executable, "-m", "mla_func.cli"]


def mla_func(*args: str, timeout: int = 240, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    command = mla_func_command()
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=env or ENV,
                          input=stdin if stdin is not None else "")


def before_the_load(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """`mla-func ARGS` for a command that ends before any model loads (--help, --version, an argument the
    parser or the checks after it refuse): `cli.main` in this process, its exit status and output as a
    subprocess's would be, without a few seconds of interpreter start. A test runs each kind of mistake
    in a subprocess (`mla_func`) at least once; its further variants take this."""
    capsys.readouterr()  # what the test printed before (a checkpoint's save progress bar) is not the command's
    try:
        code = cli.main(list(args))
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["mla-func", *args], code or 0, out, err)
