"""The Triton and AITER op tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_func.kernels import ops_for


def test_triton_table_names_every_op():
    table = ops_for("triton")
    assert table.backend == "triton"
    for field in dataclasses.fields(table):
        assert getattr(table, field.name) is not None
    assert table.rope.__module__.endswith("triton.rope")
    assert table.mla_decode.__module__.endswith("triton.decode")


def test_aiter_table_fails_loudly_without_aiter():
    try:
        import aiter  # noqa: F401
    except ImportError:
        from mla_func.kernels import aiter as aiter_kernels

        with pytest.raises(RuntimeError, match="aiter"):
            aiter_kernels.ops()
    else:
        pytest.skip("aiter is installed; covered by test_aiter.py")


def test_aiter_page_list_matches_block_table(device):
    from mla_func.kernels.aiter import token_page_list

    table = torch.tensor([[3, 1, 4], [2, 0, 5]], dtype=torch.int32, device=device)
    lens = torch.tensor([6, 0], dtype=torch.int32, device=device)
    indptr, indices = token_page_list(table, lens, 4)
    assert indptr.tolist() == [0, 6, 6]
    assert indices[:6].tolist() == [12, 13, 14, 15, 4, 5]
