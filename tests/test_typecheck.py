"""mypy over the installed package layout: mla_func with kernels/ and state/ as its subpackages.

The repository keeps `kernels/` and `state/` at the top level and installs them as
`mla_func.kernels` and `mla_func.state` (setuptools package-dir), a mapping mypy
cannot follow; the test lays the package out as it is installed, with symlinks,
and checks it with the configuration in pyproject.toml.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_package_type_checks(tmp_path):
    package = tmp_path / "mla_func"
    package.mkdir()
    for entry in (ROOT / "mla_func").iterdir():
        if entry.name not in ("kernels", "state", "__pycache__"):
            (package / entry.name).symlink_to(entry)
    (package / "kernels").symlink_to(ROOT / "kernels")
    (package / "state").symlink_to(ROOT / "state")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
         str(tmp_path / ".mypy_cache"), "-p", "mla_func"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
