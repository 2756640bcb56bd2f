"""Kernel-test set-up: the device the kernels run on (the interpreter repairs live in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
