"""AITER's MLA decode and fused MoE against the reference (only where `import aiter` works)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("aiter")

from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn  # noqa: E402
from mla_func.kernels import aiter as aiter_kernels  # noqa: E402
from mla_func.kernels.reference import attention as ref_attention  # noqa: E402
from mla_func.kernels.reference import moe as ref_moe  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_decode(num_heads):
    device = torch.device("cuda")
    gen = generator(num_heads, device)
    lens = [1, 64, 65, 0, 3000]
    kv_cache, block_table = paged_cache(lens, 64, 576, torch.bfloat16, device, gen)
    q = randn((len(lens), num_heads, 576), torch.bfloat16, device, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out, lse = aiter_kernels.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=576 ** -0.5,
                                        kv_lora_rank=512)
    ref_out, ref_lse = ref_attention.mla_decode(q.double(), kv_cache.double(), block_table, seq_lens,
                                                softmax_scale=576 ** -0.5, kv_lora_rank=512)
    assert_close(out, ref_out, torch.bfloat16)
    assert_close(lse, ref_lse, torch.bfloat16, LSE_TOLERANCE)


@pytest.mark.gpu
def test_fused_moe():
    device = torch.device("cuda")
    gen = generator(1, device)
    x = randn((5, 2048), torch.bfloat16, device, gen)
    w13 = randn((64, 2816, 2048), torch.bfloat16, device, gen, scale=2048 ** -0.5)
    w2 = randn((64, 2048, 1408), torch.bfloat16, device, gen, scale=1408 ** -0.5)
    weights, ids = torch.rand((5, 64), generator=gen, device=device).topk(6, dim=1)
    ids[-1] = -1
    out = aiter_kernels.fused_moe(x, w13, w2, weights.float(), ids)
    expected = ref_moe.fused_moe(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert_close(out, expected, torch.bfloat16)
