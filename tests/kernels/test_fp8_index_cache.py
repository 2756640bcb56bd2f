"""DeepSeek-V3.2's indexer keys in FP8 (`FP8IndexCache`: e4m3 values, one float32 scale a key): the write
quantizes as the reference does, bit for bit; the scores read the keys as one byte a value and equal the
reference's over the same cache (its keys dequantized, value * scale in float32); every table takes them.

On the CPU the kernels run in Triton's interpreter; the `gpu` test runs V3.2's indexer (64 heads of 128,
blocks of 64) over long contexts.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from mla_func.kernels import ops_for
from mla_func.kernels.index_cache import FP8IndexCache, zeroed_index_cache
from mla_func.kernels.reference import dsa as ref
from mla_func.kernels.triton import dsa_indexer as tri
from support.dsa_reference import make_v32
from support.kernel_cases import generator, paged_cache, randn, strided
from support.mla_reference import rel_err
from test_dsa_indexer import oracle_index_scores


def fp8_keys(key_lens, block_size, head_dim, device, gen, magnitude=3.0):
    """A paged FP8 indexer cache holding random keys as the write stores them, and its block table."""
    dense, table = paged_cache(key_lens, block_size, head_dim, torch.float32, device, gen)
    cache = zeroed_index_cache(dense.shape[0], block_size, head_dim, kv_cache_dtype="fp8", dtype=torch.float32,
                               device=device)
    slots = torch.arange(dense.shape[0] * block_size, device=device)
    return ref.write_index_key(cache, slots, dense.view(-1, head_dim) * magnitude, inplace=True), table


def dequantized(cache: FP8IndexCache) -> torch.Tensor:
    """Every key as the scores read it: [num_blocks, bs, Di] float32."""
    return cache[torch.arange(cache.shape[0], device=cache.values.device)]


@pytest.mark.parametrize("head_dim", [32, 24])                      # a power of two; keys of a partial tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
def test_the_write_quantizes_as_the_reference_bit_for_bit(head_dim, dtype, inplace, device):
    gen = generator(head_dim, device)
    magnitudes = torch.logspace(-6, 2, 9, device=device)[:, None].to(dtype)   # each key's scale follows it
    keys = randn((9, head_dim), dtype, device, gen, scale=4.0) * magnitudes
    keys[3] = 0                                                     # an all-zero key takes the floor's scale
    slots = torch.tensor([5, 6, 7, 8, -1, 12, 13, 2, 30], device=device)
    base = ref.write_index_key(zeroed_index_cache(4, 8, head_dim, kv_cache_dtype="fp8", dtype=dtype, device=device),
                               torch.arange(32, device=device), randn((32, head_dim), dtype, device, gen), inplace=True)
    before = FP8IndexCache(base.values.clone(), base.scales.clone())
    got = tri.write_index_key(FP8IndexCache(base.values.clone(), base.scales.clone()), slots, strided(keys, gen),
                              inplace=inplace)
    want = ref.write_index_key(FP8IndexCache(base.values.clone(), base.scales.clone()), slots, keys, inplace=inplace)
    # Block 0 is the scratch block, which the reference writes padding (-1) into and the kernel skips.
    assert torch.equal(got.values[1:].view(torch.uint8), want.values[1:].view(torch.uint8))
    assert torch.equal(got.scales[1:], want.scales[1:])
    written = dequantized(got).view(-1, head_dim)[slots[slots >= 0]]
    wide = keys[slots >= 0].float()
    # e4m3 keeps 3 fraction bits (half an ulp: 2^-4 of a value) down to 2^-6, then steps of 2^-9 (the scale's units).
    scale = got.scales.view(-1)[slots[slots >= 0]][:, None]
    assert torch.all((written - wide).abs() <= torch.maximum(wide.abs() * 2 ** -4, scale * 2 ** -10))
    if not inplace:
        assert torch.equal(base.values.view(torch.uint8), before.values.view(torch.uint8))


@pytest.mark.parametrize("config", [None, tri.IndexerConfig(block_n=16, num_warps=4, num_stages=1, locate_tiles=4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_read_the_fp8_keys(dtype, config, device):
    gen = generator(7, device)
    key_lens, num_heads, head_dim = [200, 0, 17, 64, 129], 4, 32
    cache, table = fp8_keys(key_lens, 16, head_dim, device, gen)
    q = randn((len(key_lens), num_heads, head_dim), dtype, device, gen)
    weights = randn((len(key_lens), num_heads), torch.float32, device, gen, scale=num_heads ** -0.5)
    lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    got = tri.index_scores(q, weights, cache, table, lens, weight_scale=0.5, **({} if config is None else
                                                                                {"config": config}))
    want = oracle_index_scores(q, weights * 0.5, dequantized(cache), table, lens)
    hidden = torch.isinf(want)
    assert got.dtype == torch.float32 and torch.equal(torch.isinf(got), hidden)
    # The kernel multiplies each key's logits by its scale after the product: float32 rounding only.
    scale = want[~hidden].abs().max().item()
    torch.testing.assert_close(got[~hidden].double(), want[~hidden], atol=1e-5 * scale, rtol=1e-5)
    # The reference reads the same keys (value * scale): the oracle's sums in another order.
    reference = ref.index_scores(q.double(), weights.double(), cache, table, lens, weight_scale=0.5)
    torch.testing.assert_close(reference[~hidden], want[~hidden], atol=1e-9 * scale, rtol=1e-9)


@pytest.mark.parametrize("table", ["torch-invariant", "triton-invariant"])
def test_the_batch_invariant_tables_take_fp8_keys(table, device):
    backend = table.split("-")[0]
    ops = ops_for(backend, batch_invariant=True).dsa
    gen = generator(8, device)
    key_lens = [70, 0, 33]
    cache, block_table = fp8_keys(key_lens, 16, 32, device, gen)
    q = randn((3, 4, 32), torch.float32, device, gen)
    weights = randn((3, 4), torch.float32, device, gen)
    lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    got = ops.index_scores(q, weights, cache, block_table, lens)
    want = oracle_index_scores(q, weights, dequantized(cache), block_table, lens)
    hidden = torch.isinf(want)
    assert torch.equal(torch.isinf(got), hidden)
    torch.testing.assert_close(got[~hidden].double(), want[~hidden], atol=1e-4, rtol=1e-5)


@pytest.mark.slow
def test_a_v32_model_with_fp8_caches_on_triton_equals_torch(tmp_path):
    """A tiny V3.2 checkpoint (power-of-two head dims, as the Triton kernels want) with FP8 latent and
    indexer-key caches: the Triton table's prompt and decode logits are the torch table's."""
    shapes = dict(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32, index_head_dim=32,
                  hidden_size=64, q_lora_rank=32)
    make_v32("v32", seed=5, **shapes).save_pretrained(tmp_path)
    model = mf.load_model(tmp_path, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu")
    prompt, next_tokens = [(7 * i + 3) % 97 for i in range(19)], [5, 61]
    logits = {}
    for backend in ("torch", "triton"):
        state = mf.init_state(model, num_blocks=16, block_size=16, kv_cache_dtype="fp8")
        assert isinstance(state.layers[0].index_k, FP8IndexCache)
        plans = [mf.StepPlan(prefill=(mf.SeqPlan(tuple(prompt), 0, (1, 2), len(prompt)),))]
        plans += [mf.StepPlan(decode=(mf.SeqPlan((t,), len(prompt) + i, (1, 2)),)) for i, t in enumerate(next_tokens)]
        rows = []
        for plan in plans:
            batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
            out, state = mf.forward(model.params, state, batch, mode)
            rows.append(out[: mode.num_logits])
        logits[backend] = torch.cat(rows)
    assert logits["triton"].shape == (21, 97)
    assert rel_err(logits["triton"], logits["torch"]) <= 1e-4


# --- on the GPU: V3.2's indexer ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("locate_tiles", [0, 16])
def test_fp8_scores_real_sizes_on_the_gpu(locate_tiles):
    """64 heads of 128 over FP8 keys written by the Triton write, bf16 queries, contexts up to 100K keys."""
    device = torch.device("cuda")
    gen = generator(locate_tiles, device)
    key_lens, num_heads, head_dim, block_size = [100_000, 1, 0, 64, 65, 2048, 32 * 1024], 64, 128, 64
    dense, table = paged_cache(key_lens, block_size, head_dim, torch.bfloat16, device, gen)
    cache = zeroed_index_cache(dense.shape[0], block_size, head_dim, kv_cache_dtype="fp8", dtype=torch.bfloat16,
                               device=device)
    slots = torch.arange(dense.shape[0] * block_size, device=device)
    cache = tri.write_index_key(cache, slots, dense.view(-1, head_dim), inplace=True)
    want_cache = ref.write_index_key(zeroed_index_cache(dense.shape[0], block_size, head_dim, kv_cache_dtype="fp8",
                                                        dtype=torch.bfloat16, device=device),
                                     slots, dense.view(-1, head_dim), inplace=True)
    assert torch.equal(cache.values.view(torch.uint8), want_cache.values.view(torch.uint8))
    assert torch.equal(cache.scales, want_cache.scales)
    q = randn((len(key_lens), num_heads, head_dim), torch.bfloat16, device, gen)
    weights = randn((len(key_lens), num_heads), torch.float32, device, gen, scale=num_heads ** -0.5)
    lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    got = tri.index_scores(q, weights, cache, table, lens, config=tri.IndexerConfig(64, 4, 5, locate_tiles))
    want = oracle_index_scores(q, weights, dequantized(cache), table, lens)
    hidden = torch.isinf(want)
    assert torch.equal(torch.isinf(got), hidden)
    scale = want[~hidden].abs().max().item()
    torch.testing.assert_close(got[~hidden].double(), want[~hidden], atol=1e-5 * scale, rtol=1e-5)
