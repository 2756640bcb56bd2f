"""Where the Gluon kernels run (`kernels.gluon.support`): a Hopper GPU under the Triton release they are
written for; elsewhere their `tl.dot` twins."""

from __future__ import annotations

import pytest
import torch
import triton

from mla_func.kernels.gluon import support


@pytest.mark.parametrize("version, release", [("3.6.0", (3, 6)), ("3.6.0+git1a2b3c4", (3, 6)), ("3.10.1", (3, 10))])
def test_triton_release_reads_major_and_minor(version, release):
    assert support.triton_release(version) == release


def test_an_unreadable_triton_version_is_refused_by_name():
    with pytest.raises(ValueError, match="'nightly'"):
        support.triton_release("nightly")


@pytest.mark.parametrize("version, runs", [("3.6.0", True), ("3.9.0", False), ("3.5.1", False)])
def test_the_kernels_run_only_under_the_release_they_are_written_for(version, runs, monkeypatch):
    monkeypatch.setattr(support, "hopper", lambda device: True)
    monkeypatch.setattr(triton, "__version__", version)
    assert support.available(torch.device("cuda")) is runs


def test_no_gluon_kernel_without_a_hopper_gpu():
    assert not support.available(torch.device("cpu"))
