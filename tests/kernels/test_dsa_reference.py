"""The Triton DSA kernels against the torch reference ops (`kernels/reference/dsa.py`), on fresh inputs."""

from __future__ import annotations

import torch

from mla_func.kernels import ops_for

REF, TRITON = ops_for("torch").dsa, ops_for("triton").dsa
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def paged(num_blocks=24, bs=4, dim=32, dtype=torch.float32):
    return torch.randn(num_blocks, bs, dim, device=DEV, dtype=dtype)


def test_index_scores_and_top_k_match_the_reference():
    torch.manual_seed(0)
    cache = paged()
    rows, heads, width = 6, 5, 10
    q = torch.randn(rows, heads, 32, device=DEV)
    weights = torch.randn(rows, heads, device=DEV)
    table = torch.randint(1, 24, (rows, width), device=DEV, dtype=torch.int32)
    key_lens = torch.tensor([0, 1, 7, 13, 29, 40], device=DEV, dtype=torch.int32)
    got, want = (ops.index_scores(q, weights, cache, table, key_lens) for ops in (TRITON, REF))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The scores' constant factor goes with the weights, rounded as their float32 product.
    scale = (heads * 32) ** -0.5
    got_scaled, want_scaled = (ops.index_scores(q, weights, cache, table, key_lens, weight_scale=scale)
                               for ops in (TRITON, REF))
    torch.testing.assert_close(got_scaled, want_scaled, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(want_scaled, REF.index_scores(q, weights * scale, cache, table, key_lens),
                               rtol=0, atol=0)
    # Top-k of the same (reference) scores: positions, ascending, -1 filled.
    for k in (1, 8, 50):
        assert torch.equal(TRITON.top_k_indices(want, key_lens, k=k), REF.top_k_indices(want, key_lens, k=k)), k


def test_sparse_decode_and_key_write_match_the_reference():
    torch.manual_seed(1)
    cache = paged(dim=48)
    rows, heads = 5, 4
    q = torch.randn(rows, heads, 48, device=DEV)
    table = torch.randint(1, 24, (rows, 10), device=DEV, dtype=torch.int32)
    indices = torch.randint(0, 40, (rows, 12), device=DEV, dtype=torch.int32)
    indices[1, 5:] = -1
    indices[3] = -1
    indices[0, :2] = torch.tensor([40, 1000])            # past the table (10 blocks of 4): no key either
    indices[4, :] = 40 + torch.arange(12)                 # a row of nothing but positions past it
    w_uv = torch.randn(heads, 8, 32, device=DEV)
    args = dict(softmax_scale=0.25, kv_lora_rank=32)
    for w in (None, w_uv):
        (out, lse), (ref_out, ref_lse) = (ops.sparse_mla_decode(q, cache, table, indices, w_uv=w, **args)
                                          for ops in (TRITON, REF))
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    out, lse = REF.sparse_mla_decode(q, cache, table, indices, **args)
    assert torch.all(out[4] == 0) and torch.all(lse[4] == float("-inf"))
    slots = torch.tensor([5, -1, 17], device=DEV)
    keys = torch.randn(3, 32, device=DEV)
    base = paged()
    got = TRITON.write_index_key(base.clone(), slots, keys, inplace=False)
    want = REF.write_index_key(base.clone(), slots, keys, inplace=False)
    # Block 0 is the scratch block: the reference lets a skipped row write there, the kernel does not.
    assert torch.equal(got[1:], want[1:])
    assert torch.equal(got.flatten(0, 1)[5], keys[0]) and torch.equal(got.flatten(0, 1)[17], keys[2])
