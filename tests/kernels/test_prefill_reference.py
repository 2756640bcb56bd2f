"""The reference prefill: decompressed attention per sequence, gradients, and memory linear in the tokens."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.kernel_cases import generator, paged_cache, randn
from mla_func.kernels.reference import attention as ref

H, DN, R, DV, C, BS = 3, 8, 4, 6, 16, 4


def _batch(specs, pad_tokens, seed, dtype=torch.float64):
    """specs: (context, new tokens) per sequence; a trailing (0, 0) entry is a padded sequence."""
    gen = generator(seed, "cpu")
    seq_lens = [c + n for c, n in specs]
    kv_cache, block_table = paged_cache(seq_lens, BS, C + R, dtype, "cpu", gen)
    new = [n for _, n in specs]
    num_tokens = sum(new) + pad_tokens
    positions = [p for c, n in specs for p in range(c, c + n)] + [3] * pad_tokens
    return dict(
        q_nope=randn((num_tokens, H, DN), dtype, "cpu", gen),
        q_pe=randn((num_tokens, H, R), dtype, "cpu", gen),
        kv_cache=kv_cache,
        block_table=block_table,
        cu_seqlens_q=torch.tensor([0] + new).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        positions=torch.tensor(positions),
        w_uk=randn((H, DN, C), dtype, "cpu", gen, scale=C ** -0.5),
        w_uv=randn((H, DV, C), dtype, "cpu", gen, scale=C ** -0.5),
    )


def _naive(batch, scale):
    """Decompressed keys and values of each sequence; each token attends to its own prefix."""
    kv = ref.gather_pages(batch["kv_cache"], batch["block_table"])
    cu = batch["cu_seqlens_q"].tolist()
    num_tokens = batch["q_nope"].shape[0]
    out = torch.zeros(num_tokens, H, DV, dtype=kv.dtype)
    lse = torch.full((num_tokens, H), float("-inf"), dtype=kv.dtype)
    for b, n in enumerate(batch["seq_lens"].tolist()):
        latent, k_pe = kv[b, :n, :C], kv[b, :n, C:]
        k_nope = torch.einsum("sc,hdc->shd", latent, batch["w_uk"])
        value = torch.einsum("sc,hvc->shv", latent, batch["w_uv"])
        for t in range(cu[b], cu[b + 1]):
            seen = batch["positions"][t].item() + 1
            scores = (torch.einsum("hd,shd->hs", batch["q_nope"][t], k_nope[:seen])
                      + torch.einsum("hr,sr->hs", batch["q_pe"][t], k_pe[:seen])) * scale
            lse[t] = torch.logsumexp(scores, -1)
            out[t] = torch.einsum("hs,shv->hv", torch.softmax(scores, -1), value[:seen])
    return out, lse


@pytest.mark.parametrize("specs, pad_tokens", [
    ([(0, 9)], 0),                              # one sequence, read in place
    ([(5, 3)], 2),                              # one sequence with context, padded tokens
    ([(0, 4), (7, 2), (2, 5)], 0),              # several sequences, gathered per token
    ([(3, 1), (0, 6), (0, 0)], 3),              # a padded sequence and padded tokens
])
def test_matches_decompressed_attention_per_sequence(specs, pad_tokens):
    batch = _batch(specs, pad_tokens, seed=len(specs) * 10 + pad_tokens)
    out, lse = ref.prefill_attention(**batch, softmax_scale=0.3)
    expected, expected_lse = _naive(batch, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected_lse.float(), rtol=1e-6, atol=1e-6)
    real = sum(n for _, n in specs)
    assert torch.all(out[real:] == 0) and torch.all(lse[real:] == float("-inf"))


@pytest.mark.parametrize("specs", [[(2, 6)], [(0, 4), (3, 3), (0, 0)]])
def test_gradients_under_torch_func_match_the_naive_attention(specs):
    batch = _batch(specs, pad_tokens=2, seed=3 + len(specs))
    weight = torch.randn(batch["q_nope"].shape[0], H, DV, generator=generator(9, "cpu"), dtype=torch.float64)

    def loss(attention, q_nope, kv_cache, w_uv):
        args = dict(batch, q_nope=q_nope, kv_cache=kv_cache, w_uv=w_uv)
        return (attention(args, 0.3)[0] * weight).sum()

    inputs = (batch["q_nope"], batch["kv_cache"], batch["w_uv"])
    grads = torch.func.grad(lambda *a: loss(lambda b, s: ref.prefill_attention(**b, softmax_scale=s), *a),
                            argnums=(0, 1, 2))(*inputs)
    expected = torch.func.grad(lambda *a: loss(_naive, *a), argnums=(0, 1, 2))(*inputs)
    for got, want in zip(grads, expected):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


def _largest_intermediate(num_seqs: int, tokens_per_seq: int) -> tuple[int, int]:
    batch = _batch([(4 * BS - tokens_per_seq, tokens_per_seq)] * num_seqs, 0, seed=num_seqs)
    with _LargestTensor() as mode:
        ref.prefill_attention(**batch, softmax_scale=0.3)
    return mode.largest, batch["block_table"].shape[1] * BS


def test_memory_is_linear_in_the_step_tokens():
    # Doubling the sequences of a step doubles its tokens: the largest intermediate
    # may double too, but not quadruple as a [T, B, S] cross product would.
    small, context = _largest_intermediate(num_seqs=8, tokens_per_seq=2)
    large, same_context = _largest_intermediate(num_seqs=16, tokens_per_seq=2)
    assert context == same_context
    assert large <= 2 * small
    num_tokens = 16 * 2
    assert large <= num_tokens * context * max(H, C + R)
