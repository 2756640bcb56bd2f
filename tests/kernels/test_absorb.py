"""The Triton absorbed decode query against the reference."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import TOLERANCE, generator, randn, strided
from mla_func.kernels.reference.attention import absorb_query as ref_absorb_query
from mla_func.kernels.triton.absorb import absorb_query


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 5, 70])               # one, part of and several sequence tiles
@pytest.mark.parametrize("heads, nope_dim, kv_lora_rank, rope_dim", [(3, 8, 16, 4), (2, 24, 96, 8)])
def test_absorb_query_matches_reference(dtype, num_seqs, heads, nope_dim, kv_lora_rank, rope_dim, device):
    gen = generator(num_seqs * 31 + nope_dim, device)
    # q_nope and q_pe as the model has them: strided slices of the whole query.
    q = randn((num_seqs, heads, nope_dim + rope_dim), dtype, device, gen)
    q_nope, q_pe = q.split([nope_dim, rope_dim], dim=-1)
    w_uk = randn((heads, nope_dim, kv_lora_rank), dtype, device, gen, scale=nope_dim ** -0.5)
    got = absorb_query(q_nope, q_pe, w_uk)
    want = ref_absorb_query(q_nope.double(), q_pe.double(), w_uk.double())
    assert got.shape == (num_seqs, heads, kv_lora_rank + rope_dim) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])
    assert torch.equal(got[..., kv_lora_rank:], q_pe)             # q_pe is copied, not recomputed


def test_absorb_query_strided_weight_and_bad_inputs(device):
    gen = generator(9, device)
    q_nope, q_pe = randn((4, 2, 8), torch.float32, device, gen), randn((4, 2, 4), torch.float32, device, gen)
    w_uk = randn((2, 8, 16), torch.float32, device, gen)
    torch.testing.assert_close(absorb_query(q_nope, q_pe, strided(w_uk, gen)), ref_absorb_query(q_nope, q_pe, w_uk),
                               **TOLERANCE[torch.float32])
    with pytest.raises(ValueError, match="q_nope"):
        absorb_query(q_nope[:, :, :6], q_pe, w_uk)
    with pytest.raises(ValueError, match="q_pe"):
        absorb_query(q_nope, q_pe[:3], w_uk)
    with pytest.raises(ValueError, match="w_uk"):
        absorb_query(q_nope, q_pe, w_uk.double())
