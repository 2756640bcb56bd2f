"""MLA's up-projections kept in FP8 (`quantized.split_heads`): the absorbed query, the value projection and
prefill's decompression read the stacked pairs (`kernels.triton.fp8_heads`), against the reference on the
dequantized weights; the batch-invariant tables take the pairs dequantized.

On the CPU the kernels run in Triton's interpreter at small sizes whose heads cut 128-row blocks (40 + 56
rows a head, the scales regrouped to blocks of 8 rows); the `gpu` tests run DeepSeek-V3's heads (128 + 128
rows, C 512, blocks of 128) in bf16.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from mla_func.checkpoint.fp8 import block_quantize
from mla_func.kernels import ops_for
from mla_func.kernels.quantized import BlockFP8Weight, split_heads
from mla_func.kernels.reference import attention as ref
from mla_func.kernels.reference import dsa as ref_dsa
from mla_func.kernels.triton.fp8_heads import fp8_absorb_query, fp8_value_projection
from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn
from test_dsa_decode import random_indices


def kv_b_pair(heads, nope_dim, v_dim, kv_lora_rank, gen, device, block=(128, 128)) -> BlockFP8Weight:
    """A random kv_b_proj [H * (Dn + Dv), C] block-quantized as the released checkpoints store it."""
    full = torch.randn((heads * (nope_dim + v_dim), kv_lora_rank), generator=gen, device=device) * kv_lora_rank ** -0.5
    values, scales = block_quantize(full, block)
    return BlockFP8Weight(values, scales, block)


def test_split_heads_keeps_every_value_and_each_heads_scales(device):
    gen = generator(0, device)
    heads, nope_dim, v_dim, rank = 3, 40, 56, 136
    kv_b = kv_b_pair(heads, nope_dim, v_dim, rank, gen, device)
    w_uk, w_uv = split_heads(kv_b, heads, (nope_dim, v_dim))
    whole = kv_b.dequantize(torch.float32).view(heads, nope_dim + v_dim, rank)
    assert w_uk.block == w_uv.block == (8, 128)                    # gcd(128, 40, 56): no block straddles a piece
    assert torch.equal(w_uk.dequantize(torch.float32), whole[:, :nope_dim])
    assert torch.equal(w_uv.dequantize(torch.float32), whole[:, nope_dim:])
    assert torch.equal(torch.cat([w_uk.values, w_uv.values], 1).view(torch.uint8),
                       kv_b.values.view(heads, -1, rank).view(torch.uint8))
    whole_blocks = kv_b_pair(2, 128, 128, 256, gen, device)        # DeepSeek-V3's heads: the blocks as stored
    w_uk, w_uv = split_heads(whole_blocks, 2, (128, 128))
    assert w_uk.block == (128, 128) and torch.equal(w_uk.scale_inv, whole_blocks.scale_inv.view(2, 2, 2)[:, :1])
    with pytest.raises(ValueError, match="heads"):
        split_heads(kv_b, 4, (nope_dim, v_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70])                       # one tile of rows, two
def test_absorb_and_value_projection_read_the_pairs(dtype, rows, device):
    gen = generator(rows, device)
    heads, nope_dim, v_dim, rank, rope_dim = 3, 40, 56, 136, 8
    w_uk, w_uv = split_heads(kv_b_pair(heads, nope_dim, v_dim, rank, gen, device), heads, (nope_dim, v_dim))
    q_nope = randn((rows, heads, nope_dim), dtype, device, gen)
    q_pe = randn((rows, heads, rope_dim), dtype, device, gen)
    got = fp8_absorb_query(q_nope, q_pe, w_uk)
    assert got.dtype == dtype and got.shape == (rows, heads, rank + rope_dim)
    assert_close(got, ref.absorb_query(q_nope.double(), q_pe.double(), w_uk), dtype)
    assert torch.equal(ops_for("triton").mla.absorb_query(q_nope, q_pe, w_uk), got)
    latent = randn((rows, heads, rank), dtype, device, gen)
    got = fp8_value_projection(latent, w_uv)
    assert got.dtype == dtype and got.shape == (rows, heads, v_dim)
    assert_close(got, torch.einsum("thc,hvc->thv", latent.double(), w_uv.dequantize(torch.float64)), dtype)


def _decode_inputs(dtype, device, gen, heads=3, rank=136, rope_dim=8):
    seq_lens = [5, 0, 23]
    kv_cache, table = paged_cache(seq_lens, 8, rank + rope_dim, dtype, device, gen)
    q = randn((len(seq_lens), heads, rank + rope_dim), dtype, device, gen)
    return q, kv_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("table", ["triton", "triton-invariant", "torch-invariant"])
def test_decodes_take_a_pair_w_uv(table, device):
    """The dense and sparse decodes of the Triton table (the value projection after the kernel) and of the
    batch-invariant tables (W_UV dequantized first) on an FP8 W_UV: the reference's answer."""
    backend, invariant = table.split("-")[0], table.endswith("invariant")
    ops = ops_for(backend, batch_invariant=invariant)
    gen = generator(3, device)
    dtype, heads, nope_dim, v_dim, rank = torch.bfloat16, 3, 40, 56, 136
    _, w_uv = split_heads(kv_b_pair(heads, nope_dim, v_dim, rank, gen, device), heads, (nope_dim, v_dim))
    q, kv_cache, block_table, seq_lens = _decode_inputs(dtype, device, gen)
    kw = dict(softmax_scale=0.1, kv_lora_rank=rank)
    out, lse = ops.mla.mla_decode(q, kv_cache, block_table, seq_lens, w_uv=w_uv, **kw)
    want, want_lse = ref.mla_decode(q.double(), kv_cache, block_table, seq_lens, w_uv=w_uv, **kw)
    assert out.shape == (3, heads, v_dim) and out.dtype == dtype
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)
    assert torch.all(out[1] == 0)
    indices = random_indices([5, 0, 23], 4, device, gen)
    out, lse = ops.dsa.sparse_mla_decode(q, kv_cache, block_table, indices, w_uv=w_uv, **kw)
    want, want_lse = ref_dsa.sparse_mla_decode(q.double(), kv_cache, block_table, indices, w_uv=w_uv, **kw)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)


@pytest.mark.parametrize("table", ["triton", "triton-invariant", "torch-invariant"])
def test_latent_write_absorbs_with_a_pair_w_uk(table, device):
    backend, invariant = table.split("-")[0], table.endswith("invariant")
    ops, reference = ops_for(backend, batch_invariant=invariant), ops_for("torch")
    gen = generator(4, device)
    dtype, heads, nope_dim, v_dim, rank, rope_dim, tokens = torch.bfloat16, 3, 40, 56, 136, 8, 6
    w_uk, _ = split_heads(kv_b_pair(heads, nope_dim, v_dim, rank, gen, device), heads, (nope_dim, v_dim))
    kv_cache = torch.zeros((4, 8, rank + rope_dim), dtype=dtype, device=device)
    args = (torch.tensor([9, 10, -1, 11, 12, 13], device=device), randn((tokens, rank + rope_dim), dtype, device, gen),
            1 + 0.1 * randn((rank,), dtype, device, gen), randn((tokens, heads, nope_dim), dtype, device, gen),
            randn((tokens, heads, rope_dim), dtype, device, gen), w_uk, torch.arange(tokens, device=device),
            randn((16, rope_dim // 2), torch.float32, device, gen),
            randn((16, rope_dim // 2), torch.float32, device, gen))
    kw = dict(eps=1e-6, interleaved=False, absorb_from=2, inplace=False)
    got_cache, got_pe, got_q = ops.mla.write_latent_absorb(kv_cache, *args, **kw)
    want_cache, want_pe, want_q = reference.mla.write_latent_absorb(kv_cache, *args, **kw)
    assert got_q.shape == (tokens - 2, heads, rank + rope_dim)
    assert_close(got_cache[1:], want_cache[1:], dtype)       # block 0 is the scratch block padding may write
    assert_close(got_pe, want_pe, dtype)
    assert_close(got_q, want_q, dtype)
    assert not kv_cache.any()
    q_nope, q_pe = args[3], args[4]
    assert_close(ops.mla.absorb_query(q_nope, q_pe, w_uk), reference.mla.absorb_query(q_nope, q_pe, w_uk), dtype)
    with pytest.raises(ValueError, match="absorb_from"):
        ops.mla.write_latent_absorb(kv_cache, *args, **dict(kw, absorb_from=tokens + 1))


@pytest.mark.parametrize("block", [(128, 128), (16, 24)])           # the FP8 linear; a K block it cannot step
def test_prefill_decompresses_through_the_pairs(block, device):
    """Triton's prefill (power-of-two head dims) with W_UK, W_UV pairs: keys and values decompressed by the
    FP8 linear over the heads' rows, or from the dequantized weights where its K block does not fit."""
    gen = generator(5, device)
    dtype, heads, nope_dim, v_dim, rank, rope_dim = torch.bfloat16, 2, 32, 32, 64, 16
    w_uk, w_uv = split_heads(kv_b_pair(heads, nope_dim, v_dim, rank, gen, device, block), heads, (nope_dim, v_dim))
    specs = [(0, 9), (17, 12)]
    seq_lens = [c + n for c, n in specs]
    kv_cache, block_table = paged_cache(seq_lens, 16, rank + rope_dim, dtype, device, gen)
    tokens = sum(n for _, n in specs)
    args = (randn((tokens, heads, nope_dim), dtype, device, gen), randn((tokens, heads, rope_dim), dtype, device, gen),
            kv_cache, block_table, torch.tensor([0, 9, 21], dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            torch.cat([torch.arange(c, c + n, device=device) for c, n in specs]).long(), w_uk, w_uv)
    out, lse = ops_for("triton").mla.prefill_attention(*args, softmax_scale=0.2)
    want, want_lse = ops_for("torch").mla.prefill_attention(*args, softmax_scale=0.2)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)


@pytest.mark.slow
def test_an_fp8_model_on_triton_equals_torch():
    """The `tiny` preset in FP8 (W_UK and W_UV pairs on blocks of 16 rows) in float32: prompt logits and greedy
    tokens of the Triton table (every up-projection read from FP8) are the torch table's."""
    model = mf.load_model("tiny", dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu", seed=3,
                          quantization="fp8")
    assert isinstance(model.params.layers[0].attn.w_uv, BlockFP8Weight)
    prompts = [list(range(3, 30)), list(range(40, 47))]
    greedy = mf.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        engine = mf.Engine(model, backend=backend, graphs=False, max_num_seqs=2, max_model_len=64)
        runs[backend] = engine.score(prompts[0]), [c.token_ids for c in engine.generate(prompts, greedy)]
    torch.testing.assert_close(runs["triton"][0], runs["torch"][0], atol=1e-4, rtol=1e-4)
    assert runs["triton"][1] == runs["torch"][1]


# --- on the GPU: DeepSeek-V3's heads --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_v3_heads_on_the_gpu(rows):
    """128 heads of 128 + 128 rows over C 512 (kv_b_proj's blocks whole per head), bf16."""
    device = torch.device("cuda")
    gen = generator(rows, device)
    heads, nope_dim, v_dim, rank, rope_dim = 128, 128, 128, 512, 64
    w_uk, w_uv = split_heads(kv_b_pair(heads, nope_dim, v_dim, rank, gen, device), heads, (nope_dim, v_dim))
    assert w_uk.block == (128, 128)
    q_nope = randn((rows, heads, nope_dim), torch.bfloat16, device, gen)
    q_pe = randn((rows, heads, rope_dim), torch.bfloat16, device, gen)
    got = fp8_absorb_query(q_nope, q_pe, w_uk)
    assert_close(got, ref.absorb_query(q_nope.double(), q_pe.double(), w_uk), torch.bfloat16)
    latent = randn((rows, heads, rank), torch.bfloat16, device, gen)
    got = fp8_value_projection(latent, w_uv)
    assert_close(got, torch.einsum("thc,hvc->thv", latent.double(), w_uv.dequantize(torch.float64)), torch.bfloat16)
