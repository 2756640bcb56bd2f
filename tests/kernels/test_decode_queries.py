"""The reference MLA decode with several causal query tokens per sequence."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, paged_cache, randn
from mla_func.kernels.reference import attention as ref


@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_each_query_sees_its_own_prefix(q_len):
    # Query j of a sequence with q_len rows is the one-query decode of the same
    # sequence cut to seq_len - (q_len - 1 - j) keys.
    gen = generator(q_len, "cpu")
    seq_lens, heads, rank, rope, bs = [q_len, 9, 0, 17], 3, 16, 8, 4
    kv_cache, block_table = paged_cache(seq_lens, bs, rank + rope, torch.float64, "cpu", gen)
    w_uv = randn((heads, 6, rank), torch.float64, "cpu", gen)
    q = randn((len(seq_lens) * q_len, heads, rank + rope), torch.float64, "cpu", gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out, lse = ref.mla_decode(q, kv_cache, block_table, lens, softmax_scale=0.3, kv_lora_rank=rank,
                              w_uv=w_uv, q_len=q_len)
    assert out.shape == (len(seq_lens) * q_len, heads, 6) and lse.shape == (len(seq_lens) * q_len, heads)
    for b, n in enumerate(seq_lens):
        for j in range(q_len):
            row = b * q_len + j
            cut = torch.tensor([max(n - (q_len - 1 - j), 0) if n else 0], dtype=torch.int32)
            one, one_lse = ref.mla_decode(q[row : row + 1], kv_cache, block_table[b : b + 1], cut,
                                          softmax_scale=0.3, kv_lora_rank=rank, w_uv=w_uv)
            torch.testing.assert_close(out[row : row + 1], one, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse[row : row + 1], one_lse, rtol=1e-12, atol=1e-12)
    padded = slice(2 * q_len, 3 * q_len)
    assert torch.all(out[padded] == 0) and torch.all(lse[padded] == float("-inf"))


def test_rows_not_a_multiple_of_q_len_are_refused():
    q = torch.zeros(5, 2, 24)
    with pytest.raises(ValueError, match="multiple of q_len=2"):
        ref.mla_decode(q, torch.zeros(4, 4, 24), torch.zeros(2, 1, dtype=torch.int32),
                       torch.zeros(2, dtype=torch.int32), softmax_scale=1.0, kv_lora_rank=16, q_len=2)
