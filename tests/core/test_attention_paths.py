"""Absorbed decode and decompressed prefill compute the same attention; merging by LSE is safe."""

from __future__ import annotations

import pytest
import torch

from mla_func.kernels import ops_for
from mla_func.kernels.reference.attention import merge_attn_states, mla_decode, prefill_attention
from mla_func.kernels.reference.cache import write_kv

C, R, DN, DV, H = 16, 4, 8, 12, 3


def random_cache(generator, num_blocks=12, block_size=4, dtype=torch.float64):
    return torch.randn(num_blocks, block_size, C + R, generator=generator, dtype=dtype)


@pytest.mark.parametrize("seq_lens", [[1, 4, 5, 13], [8, 3, 16, 9]])
def test_absorbed_decode_equals_decompressed_attention(seq_lens):
    g = torch.Generator().manual_seed(sum(seq_lens))
    cache = random_cache(g)
    block_table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 2], [3, 7, 1, 4]], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q_nope = torch.randn(4, H, DN, generator=g, dtype=torch.float64)
    q_pe = torch.randn(4, H, R, generator=g, dtype=torch.float64)
    w_uk = torch.randn(H, DN, C, generator=g, dtype=torch.float64)
    w_uv = torch.randn(H, DV, C, generator=g, dtype=torch.float64)
    scale = 0.3

    # decompressed: each query is the last token of a one-token prefill chunk
    out_naive, lse_naive = prefill_attention(
        q_nope, q_pe, cache, block_table, torch.arange(5, dtype=torch.int32), lens, (lens - 1).long(),
        w_uk, w_uv, softmax_scale=scale,
    )
    # absorbed: q_nope through W_UK, attention in latent space, then W_UV
    q_absorbed = torch.cat([torch.einsum("bhd,hdc->bhc", q_nope, w_uk), q_pe], dim=-1)
    latent, lse_absorbed = mla_decode(q_absorbed, cache, block_table, lens, softmax_scale=scale, kv_lora_rank=C)
    out_absorbed = torch.einsum("bhc,hvc->bhv", latent, w_uv)
    torch.testing.assert_close(out_absorbed, out_naive, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse_absorbed, lse_naive, rtol=1e-6, atol=1e-6)


def test_decode_of_padded_rows_is_zero_with_lse_minus_inf():
    g = torch.Generator().manual_seed(0)
    cache = random_cache(g)
    q = torch.randn(3, H, C + R, generator=g, dtype=torch.float64)
    out, lse = mla_decode(q, cache, torch.tensor([[1, 2], [0, 0], [3, 4]], dtype=torch.int32),
                          torch.tensor([5, 0, 2], dtype=torch.int32), softmax_scale=1.0, kv_lora_rank=C)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[[0, 2]]).all()


def test_prefill_padding_rows_give_zero():
    g = torch.Generator().manual_seed(1)
    cache = random_cache(g)
    t = 7  # 5 real tokens then 2 padded
    out, lse = prefill_attention(
        torch.randn(t, H, DN, generator=g, dtype=torch.float64), torch.randn(t, H, R, generator=g, dtype=torch.float64),
        cache, torch.tensor([[1, 2], [0, 0]], dtype=torch.int32), torch.tensor([0, 5, 5], dtype=torch.int32),
        torch.tensor([5, 0], dtype=torch.int32), torch.tensor([0, 1, 2, 3, 4, 0, 0]),
        torch.randn(H, DN, C, generator=g, dtype=torch.float64), torch.randn(H, DV, C, generator=g, dtype=torch.float64),
        softmax_scale=0.5,
    )
    assert torch.all(out[5:] == 0) and torch.all(lse[5:] == float("-inf"))
    assert torch.isfinite(out[:5]).all()


def test_merge_attn_states_matches_attention_over_the_union_and_handles_empty_sides():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(6, 2, 10, generator=g, dtype=torch.float64)
    values = torch.randn(6, 2, 10, 5, generator=g, dtype=torch.float64)

    def attend(mask):
        s = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)))
        return torch.einsum("ths,thsd->thd", p, values), lse

    split = torch.zeros(10, dtype=torch.bool)
    split[:4] = True
    mask_a = split.expand(6, 2, 10).clone()
    mask_b = ~mask_a
    mask_a[0] = False            # row 0: side a empty
    mask_b[1] = False            # row 1: side b empty
    mask_a[2] = mask_b[2] = False  # row 2: both empty
    out_a, lse_a = attend(mask_a)
    out_b, lse_b = attend(mask_b)
    # non-contiguous inputs: transposed views with the same values
    out_b_nc = out_b.transpose(0, 1).contiguous().transpose(0, 1)
    lse_b_nc = lse_b.t().contiguous().t()
    assert not out_b_nc.is_contiguous()
    out, lse = merge_attn_states(out_a, lse_a, out_b_nc, lse_b_nc)
    want, want_lse = attend(mask_a | mask_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]])
    torch.testing.assert_close(lse[[0, 1, 3, 4, 5]].double(), want_lse[[0, 1, 3, 4, 5]])
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))


@pytest.mark.parametrize("inplace", [True, False])
def test_write_kv_skips_padding_and_respects_inplace(inplace):
    g = torch.Generator().manual_seed(3)
    cache = random_cache(g, dtype=torch.float32)
    before = cache.clone()
    kv = torch.randn(4, C + R, generator=g)
    slots = torch.tensor([5, -1, 17, -1])
    out = write_kv(cache, slots, kv, inplace=inplace)
    flat = out.view(-1, C + R)
    torch.testing.assert_close(flat[5], kv[0])
    torch.testing.assert_close(flat[17], kv[2])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[[5, 17]] = False
    untouched[: cache.shape[1]] = False  # the scratch block may take padding writes
    torch.testing.assert_close(flat[untouched], before.view(-1, C + R)[untouched])
    assert (out is cache) == inplace
    if not inplace:
        torch.testing.assert_close(cache, before)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        ops_for("cuda-magic")
