"""DeepSeek-V4's reference ops (and the indexer ops it shares with V3.2) against plain formulas written here."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_func.kernels.reference.attention import merge_attn_states
from mla_func.kernels.reference.dsa import index_scores, top_k_indices
from mla_func.kernels.reference.v4_attention import pool_entries, rope_tail, scope_attention


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), levels=st.integers(2, 5))
def test_top_k_lists_the_best_visible_positions_ascending_ties_to_the_lower(seed, k, levels):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (5, 9), generator=generator).float()      # few levels: many ties
    key_lens = torch.randint(0, 10, (5,), generator=generator, dtype=torch.int32)
    scores = scores.masked_fill(torch.arange(9) >= key_lens.unsqueeze(1), float("-inf"))
    got = top_k_indices(scores, key_lens, k=k)
    for t in range(5):
        visible = list(range(int(key_lens[t])))
        best = sorted(visible, key=lambda j: (-float(scores[t, j]), j))[:k]
        want = sorted(best) + [-1] * (k - len(best))
        assert got[t].tolist() == want


def test_index_scores_over_the_paged_cache():
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 2, 8, generator=generator)
    table = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    q, weights = torch.randn(2, 4, 8, generator=generator), torch.rand(2, 4, generator=generator)
    key_lens = torch.tensor([3, 6], dtype=torch.int32)
    got = index_scores(q, weights, cache, table, key_lens)
    assert got.shape == (2, 6)
    for t in range(2):
        for j in range(6):
            key = cache[table[t, j // 2], j % 2]
            want = sum(float(weights[t, h]) * max(float(q[t, h] @ key), 0.0) for h in range(4))
            if j < key_lens[t]:
                assert abs(float(got[t, j]) - want) < 1e-5
            else:
                assert got[t, j] == float("-inf")


def test_scopes_merged_with_a_sink_equal_one_softmax_over_all_keys_and_the_sink():
    generator = torch.Generator().manual_seed(1)
    q, keys = torch.randn(3, 2, 4, generator=generator), torch.randn(3, 7, 4, generator=generator)
    valid = torch.rand(3, 7, generator=generator) > 0.4
    valid[2] = False                                                                    # a row with no key
    sinks = torch.randn(2, generator=generator)
    out_a, lse_a = scope_attention(q, keys[:, :3], valid[:, :3], softmax_scale=0.5)
    out_b, lse_b = scope_attention(q, keys[:, 3:], valid[:, 3:], softmax_scale=0.5)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    out, _ = merge_attn_states(out, lse, torch.zeros_like(out), sinks.expand(3, -1))
    logits = torch.einsum("nhd,nld->nhl", q, keys) * 0.5
    logits = torch.cat([logits.masked_fill(~valid.unsqueeze(1), float("-inf")), sinks.view(1, 2, 1).expand(3, 2, 1)], -1)
    probs = logits.softmax(-1)[..., :-1]
    torch.testing.assert_close(out, torch.einsum("nhl,nld->nhd", probs, keys), rtol=1e-5, atol=1e-6)
    assert bool((out[2] == 0).all())


def test_pooling_is_a_gated_softmax_sum_and_an_empty_pool_is_zero():
    generator = torch.Generator().manual_seed(2)
    kv, gate = torch.randn(2, 5, 3, generator=generator), torch.randn(2, 5, 3, generator=generator)
    valid = torch.tensor([[True, False, True, True, False], [False] * 5])
    got = pool_entries(kv, gate.masked_fill(~valid.unsqueeze(-1), float("nan")), valid)
    weights = gate[0, [0, 2, 3]].softmax(dim=0)
    torch.testing.assert_close(got[0], (weights * kv[0, [0, 2, 3]]).sum(0))
    assert bool((got[1] == 0).all())


def test_rope_tail_rotates_interleaved_pairs_of_the_tail_and_inverts():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 10, generator=generator)
    angle = torch.rand(4, 1, 3, generator=generator) * 6
    rotated = rope_tail(x, angle.cos(), angle.sin())
    assert torch.equal(rotated[..., :4], x[..., :4])
    pair = torch.complex(x[..., 4::2], x[..., 5::2]) * torch.exp(1j * angle)
    torch.testing.assert_close(rotated[..., 4::2], pair.real)
    torch.testing.assert_close(rotated[..., 5::2], pair.imag)
    torch.testing.assert_close(rope_tail(rotated, angle.cos(), angle.sin(), inverse=True), x)
