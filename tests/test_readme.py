"""The README's examples run as written, and its test commands are the ones CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, flags=re.MULTILINE | re.DOTALL)


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def indented_commands(text: str) -> list[str]:
    """The lines of the section's indented (4-space) code blocks."""
    return [line[4:] for line in text.splitlines() if line.startswith("    ") and line.strip()]


def test_the_readme_has_python_examples():
    assert len(PYTHON_BLOCKS) >= 4
    assert any('load_model("demo")' in block for block in PYTHON_BLOCKS)
    assert any("save_pretrained" in block for block in PYTHON_BLOCKS)


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_example_runs_as_written(index, tmp_path):
    # Each block alone, in a fresh interpreter, in an empty folder (a checkpoint it writes lands there).
    block = PYTHON_BLOCKS[index]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, f"README example {index} failed:\n{block}\n{result.stderr}"
    assert "Traceback" not in result.stderr
    if "print(" in block:
        assert result.stdout.strip(), f"README example {index} printed nothing"


def test_the_readme_test_commands_are_what_ci_runs():
    readme = indented_commands(section("Tests").split("On a CUDA machine")[0])
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [line for line in script if line and not line.startswith(("#", "set ", "unset ", "cd ", "rm "))]
    assert readme == ci
    # A new environment first, so that a test needing an undeclared package fails here as it would for a user.
    assert readme[0] == "python3 -m venv .venv && . .venv/bin/activate"
    assert readme[1].startswith("python3 -m pip install") and '".[test]"' in readme[1]
    assert readme[2] == 'python3 -m pytest -m "not gpu" -q -n auto --dist loadscope --durations=20'


def test_the_readme_set_up_commands_install_and_run_the_demo():
    commands = indented_commands(section("Set up and run").split("\n\n", 2)[1])
    assert commands[0].startswith("pip install") and commands[0].endswith("-e .")
    assert commands[1].startswith("mla-func generate ")
