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


def test_aiter_decode_of_several_queries_is_the_reference(device):
    # AITER's kernel serves one query a sequence; q_len > 1 is named to run the reference.
    from kernel_cases import generator, paged_cache, randn
    from mla_func.kernels import aiter as aiter_kernels
    from mla_func.kernels.reference import attention as ref_attention

    gen = generator(5, device)
    lens = [3, 9, 0]
    kv_cache, block_table = paged_cache(lens, 4, 24, torch.float32, device, gen)
    q = randn((3 * len(lens), 2, 24), torch.float32, device, gen)
    w_uv = randn((2, 8, 16), torch.float32, device, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    kwargs = dict(softmax_scale=0.2, kv_lora_rank=16, w_uv=w_uv, q_len=3)
    out, lse = aiter_kernels.mla_decode(q, kv_cache, block_table, seq_lens, **kwargs)
    ref_out, ref_lse = ref_attention.mla_decode(q, kv_cache, block_table, seq_lens, **kwargs)
    assert out.shape == (9, 2, 8)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
