"""Triton fused MoE against the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.kernel_cases import assert_close, generator, randn, strided
from mla_func.kernels.reference import moe as ref
from mla_func.kernels.triton import moe as tri


def _inputs(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed, padded_rows=0):
    gen = generator(seed, device)
    x = randn((num_tokens, hidden), dtype, device, gen)
    w13 = randn((num_experts, 2 * inter, hidden), dtype, device, gen, scale=hidden ** -0.5)
    w2 = randn((num_experts, hidden, inter), dtype, device, gen, scale=inter ** -0.5)
    scores = torch.rand((num_tokens, num_experts), generator=gen, device=device)
    topk_weights, topk_ids = scores.topk(top_k, dim=1)
    topk_weights = topk_weights / topk_weights.sum(1, keepdim=True)
    if padded_rows:
        topk_ids[-padded_rows:] = -1
    if num_tokens > 2 and top_k > 1:
        topk_ids[1, 0] = -1        # a single dropped slot in a real row
    return x, w13, w2, topk_weights.float(), topk_ids


def _config(path, inputs):
    x, w13, _, _, ids = inputs
    if path == "pair":
        return tri.pair_config(x.device)
    return tri.tiled_config(ids.numel(), w13.shape[0], x.device, x.dtype)


def _check(inputs, dtype, path=None, out_dtype=None):
    config = _config(path, inputs) if path else None
    out = tri.fused_moe(*inputs, config=config, out_dtype=out_dtype)
    x, w13, w2, weights, ids = inputs
    expected = ref.fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert out.dtype == (out_dtype or dtype) and out.shape == x.shape
    assert_close(out, expected, dtype)
    return out


@pytest.mark.parametrize("path", ["pair", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fused_moe(path, dtype, num_tokens, device):
    inputs = _inputs(num_tokens, 64, 48, 8, 3, dtype, device, seed=num_tokens, padded_rows=1)
    out = _check(inputs, dtype, path)
    assert torch.all(out[-1] == 0)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 40])
def test_default_path_and_float32_out(num_tokens, device):
    # The default picks the per-pair path up to PAIR_MAX_PAIRS pairs, the tiled one above;
    # either can return float32 sums of bf16 experts.
    inputs = _inputs(num_tokens, 64, 48, 8, 6, torch.bfloat16, device, seed=10 + num_tokens)
    want = tri.PairConfig if num_tokens * 6 <= tri.PAIR_MAX_PAIRS else tri.MoeConfig
    assert isinstance(tri.moe_config(num_tokens * 6, 8, device), want)
    out = _check(inputs, torch.bfloat16, out_dtype=torch.float32)
    # Rounding the float32 result gives the bf16 result up to the order of the float32 sums.
    assert_close(out.to(torch.bfloat16), tri.fused_moe(*inputs), torch.bfloat16)


def test_down_kernel_pipeline_depth_of_its_own(device):
    # `down_stages` changes how far ahead the down kernel loads, never what it computes.
    inputs = _inputs(40, 64, 48, 8, 3, torch.bfloat16, device, seed=7)
    base = tri.tiled_config(120, 8, device, torch.bfloat16)
    deeper = dataclasses.replace(base, down_stages=base.num_stages + 1)
    assert torch.equal(tri.fused_moe(*inputs, config=deeper), tri.fused_moe(*inputs, config=base))
    # float32 tiles take twice the shared memory: on a GPU both kernels then keep to two stages.
    for num_pairs in (64, 448, 4096):
        config = tri.tiled_config(num_pairs, 9, torch.device("cuda"), torch.float32)
        assert max(config.num_stages, config.down_stages) <= 2, config


@pytest.mark.parametrize("path", ["pair", "tiled"])
def test_odd_sizes_and_many_experts(path, device):
    # Sizes off every block multiple; more experts than pairs.
    _check(_inputs(3, 72, 40, 20, 6, torch.float32, device, seed=2), torch.float32, path)


@pytest.mark.parametrize("path", ["pair", "tiled"])
def test_reads_only_chosen_experts(path, device):
    inputs = _inputs(4, 64, 32, 8, 2, torch.float32, device, seed=3)
    config = _config(path, inputs)
    x, w13, w2, weights, ids = inputs
    unused = torch.ones(8, dtype=torch.bool, device=device)
    unused[ids[ids >= 0]] = False
    expected = ref.fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
    # NaN weights in experts no token picked would poison any read of them.
    w13[unused] = float("nan")
    w2[unused] = float("nan")
    out = tri.fused_moe(x, w13, w2, weights, ids, config=config)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("path", ["pair", "tiled"])
def test_non_contiguous_inputs(path, device):
    inputs = _inputs(6, 64, 48, 8, 2, torch.bfloat16, device, seed=4)
    x, w13, w2, weights, ids = inputs
    gen = generator(5, device)
    moved = (strided(x, gen), strided(w13, gen), strided(w2, gen), strided(weights, gen), strided(ids, gen))
    out = tri.fused_moe(*moved, config=_config(path, inputs))
    expected = ref.fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("tile_pairs", [None, 16])
def test_align_groups_pairs_by_expert(tile_pairs, device):
    # tile_pairs 16 spreads the 69 pairs over five counting tiles.
    gen = generator(6, device)
    num_experts, block_m = 5, 16
    ids = torch.randint(-1, num_experts, (23, 3), generator=gen, device=device)
    sorted_pairs, block_expert = tri.moe_align(ids, num_experts, block_m, tile_pairs=tile_pairs)
    flat = ids.flatten()
    num_pairs = flat.numel()
    assert sorted_pairs.numel() == tri.moe_sorted_size(num_pairs, num_experts, block_m)
    rows = sorted_pairs.view(-1, block_m).long()
    for block, expert in enumerate(block_expert.tolist()):
        real = rows[block][rows[block] < num_pairs]
        if expert < 0:
            assert real.numel() == 0
        else:
            assert torch.all(flat[real] == expert)
            assert torch.all(real[1:] > real[:-1])       # original order kept
    listed = sorted_pairs[sorted_pairs < num_pairs].long().sort().values
    assert torch.equal(listed, torch.nonzero(flat >= 0).flatten())


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [
    (23, 3, 64, 16),         # few pairs over many experts
    (64, 8, 66, 16),         # V2-Lite's batch 64 with its two shared experts
    (128, 8, 257, 64),       # 1024 pairs, V3's 256 + 1 experts (a 512-wide expert tile)
    (206, 5, 70, 16),        # 1030 pairs: past the one-program sort
    (64, 7, 9, 64),          # V4's batch 64: few experts keep the counting tiles
])
def test_align_in_one_program_equals_the_tiled_counting_sort(num_tokens, top_k, num_experts, block_m, device):
    gen = generator(num_tokens + num_experts, device)
    ids = torch.randint(-1, num_experts, (num_tokens, top_k), generator=gen, device=device)
    ids[num_tokens // 2] = -1                                    # a padded row
    default = tri.moe_align(ids, num_experts, block_m)
    tiled = tri.moe_align(ids, num_experts, block_m, tile_pairs=64)
    assert torch.equal(default[0], tiled[0]) and torch.equal(default[1], tiled[1])


def test_rejects_bad_inputs(device):
    x, w13, w2, weights, ids = _inputs(2, 64, 32, 4, 2, torch.float32, device, seed=7)
    with pytest.raises(ValueError, match="w2"):
        tri.fused_moe(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        tri.fused_moe(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="out_dtype"):
        tri.fused_moe(x, w13, w2, weights, ids, out_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, dtype", [(1, torch.bfloat16), (16, torch.bfloat16), (2048, torch.bfloat16),
                                               (1, torch.float32), (256, torch.float32)])
def test_gpu_v2_lite_shapes(num_tokens, dtype):
    device = torch.device("cuda")
    inputs = _inputs(num_tokens, 2048, 1408, 64, 6, dtype, device, seed=num_tokens,
                     padded_rows=1 if num_tokens > 1 else 0)
    x, w13, w2, weights, ids = inputs
    out = tri.fused_moe(*inputs)
    # The reference runs all 64 experts on every token; in float32 it fits for these sizes.
    expected = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert_close(out, expected, dtype)


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_routing():
    device = torch.device("cuda")
    x, w13, w2, weights, ids = _inputs(4, 2048, 1408, 64, 6, torch.bfloat16, device, seed=8)
    tri.fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.fused_moe(x, w13, w2, weights, ids)
    gen = generator(9, device)
    for _ in range(2):
        new_ids = torch.rand((4, 64), generator=gen, device=device).topk(6, dim=1).indices
        new_ids[2] = -1
        ids.copy_(new_ids)
        graph.replay()
        expected = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
        assert_close(out, expected, torch.bfloat16)
