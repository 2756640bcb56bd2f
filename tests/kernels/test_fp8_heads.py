"""MLA's up-projections kept in FP8 (`quantized.split_heads`): the absorbed query, the value projection and
prefill's decompression read the stacked pairs (`kernels.triton.fp8_heads`), against the reference on the
dequantized weights; the batch-invariant tables take the pairs dequantized. The fused decode kernels (the
latent write's absorbed query, the split merge's value projection) read a pair's tiles dequantized and
rounded to the activations' dtype: the same answer, bit for bit, as the same kernels on that weight.

On the CPU the kernels run in Triton's interpreter at small sizes whose heads cut 128-row blocks (40 + 56
rows a head, the scales regrouped to blocks of 8 rows), and at blocks that put a fused kernel's tiles in
one scale block or across several; the `gpu` tests run DeepSeek-V3's heads (128 + 128 rows, C 512, blocks
of 128) in bf16.
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
from mla_func.kernels.reference.latent import write_latent_absorb as ref_write_latent_absorb
from mla_func.kernels.triton import decode, dsa_decode
from mla_func.kernels.triton.fp8_heads import fp8_absorb_query, fp8_value_projection
from mla_func.kernels.triton.latent import write_latent, write_latent_absorb
from support.kernel_cases import LSE_TOLERANCE, assert_close, generator, paged_cache, randn
from test_dsa_decode import oracle_sparse_decode, random_indices


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
    """The dense and sparse decodes of the Triton table (the pair read by the kernels: in the dense decode's
    split merge, by `fp8_value_projection` after the sparse one at 3 rows) and of the batch-invariant tables
    (W_UV dequantized first) on an FP8 W_UV: the reference's answer."""
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


# --- the fused decode kernels -----------------------------------------------------------------------------

# Heads of 32 + 64 rows over C 128. W_UK's tiles are [32, 64] (all of Dn, 64 columns), the split merge's W_UV
# tiles [32, 128] (a narrow program's 32 rows, all of C); each block makes `fp8_heads.head_tile` load:
FUSED_BLOCKS = [
    (32, 128),  # one scale a tile in both kernels (W_UV's two row tiles in two blocks)
    (32, 64),   # W_UK one scale a tile (two column blocks), W_UV one row block (a scale a column)
    (16, 128),  # one column block (a scale a row)
    (16, 48),   # a scale gathered for every element
]
FUSED_HEADS, FUSED_NOPE, FUSED_V, FUSED_RANK, FUSED_ROPE = 2, 32, 64, 128, 16


def _fused_pairs(block, gen, device) -> tuple[BlockFP8Weight, BlockFP8Weight]:
    w_uk, w_uv = split_heads(kv_b_pair(FUSED_HEADS, FUSED_NOPE, FUSED_V, FUSED_RANK, gen, device, block),
                             FUSED_HEADS, (FUSED_NOPE, FUSED_V))
    assert w_uk.block == w_uv.block == block
    return w_uk, w_uv


def _latent_inputs(tokens, dtype, device, gen):
    """write_latent_absorb's arguments from the cache to sin, w_uk left out (None in its place)."""
    rank, rope_dim = FUSED_RANK, FUSED_ROPE
    return [torch.zeros((4, 8, rank + rope_dim), dtype=dtype, device=device),
            torch.tensor([9, 10, -1, 11, 12, 13][:tokens], device=device),
            randn((tokens, rank + rope_dim), dtype, device, gen), 1 + 0.1 * randn((rank,), dtype, device, gen),
            randn((tokens, FUSED_HEADS, FUSED_NOPE), dtype, device, gen),
            randn((tokens, FUSED_HEADS, rope_dim), dtype, device, gen), None, torch.arange(tokens, device=device),
            randn((16, rope_dim // 2), torch.float32, device, gen),
            randn((16, rope_dim // 2), torch.float32, device, gen)]


def _with_w_uk(args, w_uk):
    return [*args[:6], w_uk, *args[7:]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", FUSED_BLOCKS)
def test_latent_write_fuses_a_pair_w_uk(block, dtype, device):
    """The one-launch latent write with a pair W_UK: the same cache, rotated q_pe and absorbed query as with
    the dequantized weight (bit for bit), and the reference's (that weight, exact products)."""
    gen = generator(6, device)
    w_uk, _ = _fused_pairs(block, gen, device)
    args = _latent_inputs(6, dtype, device, gen)
    kw = dict(eps=1e-6, interleaved=False, absorb_from=2, inplace=False)
    got = write_latent_absorb(*_with_w_uk(args, w_uk), **kw)
    dense = write_latent_absorb(*_with_w_uk(args, w_uk.dequantize(dtype)), **kw)
    for a, b in zip(got, dense):
        assert torch.equal(a, b)
    cache, q_pe, q = got
    assert q.shape == (4, FUSED_HEADS, FUSED_RANK + FUSED_ROPE) and q.dtype == dtype
    want = ref.absorb_query(args[4][2:].double(), q_pe[2:].double(), w_uk.dequantize(dtype).double())
    assert_close(q, want, dtype)
    want_cache, want_pe, _ = ref_write_latent_absorb(*_with_w_uk(args, w_uk), **kw)
    assert_close(cache[1:], want_cache[1:], dtype)           # block 0 is the scratch block padding may write
    assert_close(q_pe, want_pe, dtype)


def _projected(latent: torch.Tensor, w_uv: BlockFP8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The reference's value projection: latent [T, H, C] @ w_uv dequantized (rounded to dtype)^T, in float64."""
    return torch.einsum("thc,hvc->thv", latent.double(), w_uv.dequantize(dtype).double())


def _decode_case(kind, num_rows, dtype, device, gen):
    """A dense ("dense") or sparse decode of num_rows rows, the last one padded, at the fused tests' sizes:
    (its op, taking w_uv -> (out, lse); the reference's latent [T, H, C] float64 and lse; the most rows
    whose W_UV the split merge applies)."""
    lens = [(37 * i + 5) % 60 for i in range(num_rows)]
    lens[-1] = 0
    kv_cache, table = paged_cache(lens, 8, FUSED_RANK + FUSED_ROPE, dtype, device, gen)
    q = randn((num_rows, FUSED_HEADS, FUSED_RANK + FUSED_ROPE), dtype, device, gen)
    kw = dict(softmax_scale=0.1, kv_lora_rank=FUSED_RANK)
    if kind == "dense":
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        return (lambda w_uv: decode.mla_decode(q, kv_cache, table, seq_lens, w_uv=w_uv, num_splits=3, **kw),
                ref.mla_decode(q.double(), kv_cache.double(), table, seq_lens, **kw), decode._FUSED_VALUE_MAX_SEQS)
    indices = random_indices(lens, 24, device, gen)
    return (lambda w_uv: dsa_decode.sparse_mla_decode(q, kv_cache, table, indices, w_uv=w_uv, num_splits=2, **kw),
            oracle_sparse_decode(q, kv_cache, table, indices, 0.1, FUSED_RANK), dsa_decode._FUSED_VALUE_MAX_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", FUSED_BLOCKS)
@pytest.mark.parametrize("kind, num_rows", [("dense", 3), ("dense", decode._FUSED_VALUE_MAX_SEQS + 1),
                                            ("sparse", dsa_decode._FUSED_VALUE_MAX_ROWS),
                                            ("sparse", dsa_decode._FUSED_VALUE_MAX_ROWS + 1)])
def test_decodes_fuse_a_pair_w_uv(kind, num_rows, block, dtype, device):
    """The dense and sparse decodes with a pair W_UV: in the split merge up to their row limits (the same answer,
    bit for bit, as with the dequantized weight), by `fp8_value_projection` after it above; the reference's."""
    gen = generator(num_rows, device)
    _, w_uv = _fused_pairs(block, gen, device)
    run, (latent, want_lse), fused_rows = _decode_case(kind, num_rows, dtype, device, gen)
    out, lse = run(w_uv)
    dense, dense_lse = run(w_uv.dequantize(dtype))
    assert out.shape == (num_rows, FUSED_HEADS, FUSED_V) and out.dtype == dtype
    assert torch.equal(lse, dense_lse)
    if num_rows <= fused_rows:
        assert torch.equal(out, dense)
    assert_close(out, _projected(latent, w_uv, dtype), dtype)
    assert_close(lse, want_lse, dtype, LSE_TOLERANCE)
    assert torch.all(out[-1] == 0)


def test_fused_kernels_check_a_pair(device):
    gen = generator(12, device)
    w_uk, w_uv = _fused_pairs((32, 128), gen, device)
    args = _latent_inputs(2, torch.bfloat16, device, gen)
    kw = dict(eps=1e-6, interleaved=False, absorb_from=0)
    with pytest.raises(ValueError, match="w_uk"):
        write_latent_absorb(*_with_w_uk(args, w_uv[:1]), **kw)
    with pytest.raises(ValueError, match="w_uk"):
        write_latent_absorb(*_with_w_uk(args, w_uk.dequantize(torch.float32)), **kw)
    kv_cache, table = paged_cache([3], 8, FUSED_RANK + FUSED_ROPE, torch.bfloat16, device, gen)
    q = randn((1, FUSED_HEADS + 1, FUSED_RANK + FUSED_ROPE), torch.bfloat16, device, gen)
    with pytest.raises(ValueError, match="w_uv"):
        decode.mla_decode(q, kv_cache, table, torch.tensor([3], dtype=torch.int32, device=device),
                          softmax_scale=0.1, kv_lora_rank=FUSED_RANK, w_uv=w_uv)


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


def _v3_pairs(heads, gen, device) -> tuple[BlockFP8Weight, BlockFP8Weight]:
    """DeepSeek-V3's W_UK, W_UV pairs (128 + 128 rows a head over C 512, blocks of 128) for `heads` heads."""
    w_uk, w_uv = split_heads(kv_b_pair(heads, 128, 128, 512, gen, device), heads, (128, 128))
    assert w_uk.block == w_uv.block == (128, 128)
    return w_uk, w_uv


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_v3_latent_write_fuses_the_pair_on_the_gpu(heads):
    """The latent write with W_UK's pair in its kernel (one scale a tile): the reference's absorbed query, and
    the unfused path's (the plain latent write, then `_head_product_kernel`), in bf16."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = generator(heads + 1, device)
    w_uk, _ = _v3_pairs(heads, gen, device)
    tokens, absorb_from, rank, rope_dim = 11, 3, 512, 64                # 3 prefill rows, then 8 decode rows
    kv_cache = torch.zeros((4, 64, rank + rope_dim), dtype=dtype, device=device)
    args = (torch.arange(64, 64 + tokens, device=device), randn((tokens, rank + rope_dim), dtype, device, gen),
            1 + 0.1 * randn((rank,), dtype, device, gen), randn((tokens, heads, 128), dtype, device, gen),
            randn((tokens, heads, rope_dim), dtype, device, gen), w_uk, torch.arange(tokens, device=device),
            randn((64, rope_dim // 2), torch.float32, device, gen),
            randn((64, rope_dim // 2), torch.float32, device, gen))
    kw = dict(eps=1e-6, interleaved=False)
    cache, q_pe, q = write_latent_absorb(kv_cache.clone(), *args, absorb_from=absorb_from, **kw)
    want_cache, want_pe, _ = ref_write_latent_absorb(kv_cache.clone(), *args, absorb_from=absorb_from, **kw)
    assert_close(cache, want_cache, dtype)
    assert_close(q_pe, want_pe, dtype)
    q_nope = args[3][absorb_from:]
    assert_close(q, ref.absorb_query(q_nope.double(), q_pe[absorb_from:].double(), w_uk.dequantize(dtype).double()),
                 dtype)
    slots, latent, norm, _, q_pe_in, _, positions, cos, sin = args
    _, rotated = write_latent(kv_cache.clone(), slots, latent, norm, q_pe_in, positions, cos, sin, **kw)
    assert_close(q, fp8_absorb_query(q_nope, rotated[absorb_from:], w_uk), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_v3_decodes_fuse_the_pair_on_the_gpu(heads):
    """The dense and sparse decodes with W_UV's pair: in the split merge up to their row limits, projected after
    above them; the reference's, and the unfused path's (the plain decode, then `_head_product_kernel`), in bf16."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = generator(heads + 2, device)
    _, w_uv = _v3_pairs(heads, gen, device)
    rank, rope_dim = 512, 64
    lens = [1, 63, 64, 65, 1000, 4096, 0, 3000, 2048]
    kv_cache, table = paged_cache(lens, 64, rank + rope_dim, dtype, device, gen)
    q = randn((len(lens), heads, rank + rope_dim), dtype, device, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    kw = dict(softmax_scale=(rank + rope_dim) ** -0.5, kv_lora_rank=rank)
    _check_first_rows(lambda rows, w: decode.mla_decode(q[:rows], kv_cache, table[:rows], seq_lens[:rows], w_uv=w,
                                                        **kw),
                      ref.mla_decode(q.double(), kv_cache.double(), table, seq_lens, **kw), w_uv,
                      (1, decode._FUSED_VALUE_MAX_SEQS, decode._FUSED_VALUE_MAX_SEQS + 1))
    sparse = [4, 5, 7]                                                # rows of 1000, 4096 and 3000 keys
    q, table = q[sparse], table[sparse]
    indices = random_indices([lens[i] for i in sparse], 2048, device, gen)
    _check_first_rows(lambda rows, w: dsa_decode.sparse_mla_decode(q[:rows], kv_cache, table[:rows], indices[:rows],
                                                                   w_uv=w, **kw),
                      oracle_sparse_decode(q, kv_cache, table, indices, kw["softmax_scale"], rank), w_uv,
                      (1, dsa_decode._FUSED_VALUE_MAX_ROWS, dsa_decode._FUSED_VALUE_MAX_ROWS + 1))


def _check_first_rows(run, want, w_uv, row_counts):
    """run(rows, w_uv or None) -> (out, lse), a decode of the first `rows` rows, for each count: with w_uv the
    reference's projection of want = (latent [T, H, C], lse [T, H]), and the plain decode's through
    `fp8_value_projection` (bf16)."""
    latent, want_lse = want
    projected = _projected(latent, w_uv, torch.bfloat16)
    for rows in row_counts:
        out, lse = run(rows, w_uv)
        plain, _ = run(rows, None)
        assert_close(out, projected[:rows], torch.bfloat16)
        assert_close(lse, want_lse[:rows], torch.bfloat16, LSE_TOLERANCE)
        assert_close(out, fp8_value_projection(plain, w_uv), torch.bfloat16)
