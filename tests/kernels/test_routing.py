"""Triton MoE routing against the reference.

Gate and x are random, so no two experts of a row score within rounding of each
other: the chosen ids must match exactly, whatever the summation order.
"""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import generator, randn, strided
from mla_func.kernels.held_experts import HeldExperts
from mla_func.kernels.reference import invariant as ref_invariant
from mla_func.kernels.reference import routing as ref
from mla_func.kernels.triton import invariant as tri_invariant
from mla_func.kernels.triton import routing as tri

# (num_experts, routing arguments) of the three methods, shaped like the models that use them.
V2_LITE = (64, dict(top_k=6, scoring_func="softmax", topk_method="greedy", n_group=None, topk_group=None,
                    norm_topk_prob=False, routed_scaling_factor=1.0))
V2_GROUPED = (64, dict(top_k=6, scoring_func="softmax", topk_method="group_limited_greedy", n_group=8,
                       topk_group=3, norm_topk_prob=False, routed_scaling_factor=16.0))
V3_TINY = (8, dict(top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1,
                   norm_topk_prob=True, routed_scaling_factor=2.5))
V3 = (256, dict(top_k=8, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                norm_topk_prob=True, routed_scaling_factor=2.5))
V4_MINI = (8, dict(top_k=6, scoring_func="sqrtsoftplus", topk_method="greedy", n_group=None, topk_group=None,
                   norm_topk_prob=True, routed_scaling_factor=1.5))


def _inputs(num_tokens, hidden, num_experts, dtype, device, seed, *, bias=False, padded_rows=0):
    gen = generator(seed, device)
    x = randn((num_tokens, hidden), dtype, device, gen)
    gate = randn((num_experts, hidden), torch.float32, device, gen, scale=hidden ** -0.5)
    correction = randn((num_experts,), torch.float32, device, gen, scale=0.1) if bias else None
    valid = torch.ones(num_tokens, dtype=torch.bool, device=device)
    valid[num_tokens - padded_rows:] = False
    return x, gate, correction, valid


def _check(inputs, config=None, max_flipped_rows=0, **args):
    weights, ids = tri.route(*inputs, config=config, **args)
    x, gate, correction, valid = inputs
    # The float64 reference on the same (rounded) inputs is the truth.
    expected_weights, expected_ids = ref.route(
        x.double(), gate.double(), None if correction is None else correction.double(), valid, **args)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    same = (ids == expected_ids).all(dim=1)
    assert (~same).sum().item() <= max_flipped_rows
    torch.testing.assert_close(weights[same].double(), expected_weights[same], rtol=1e-5, atol=1e-7)
    return weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 40])
@pytest.mark.parametrize("method", [V2_LITE, V2_GROUPED, V3_TINY], ids=["greedy", "group_limited", "noaux_tc"])
def test_matches_reference(method, num_tokens, dtype, device):
    num_experts, args = method
    inputs = _inputs(num_tokens, 64, num_experts, dtype, device, seed=num_tokens,
                     bias=args["topk_method"] == "noaux_tc", padded_rows=min(2, num_tokens - 1))
    weights, ids = _check(inputs, **args)
    padded = ~inputs[3]
    assert torch.all(ids[padded] == -1) and torch.all(weights[padded] == 0)
    assert torch.all(ids[~padded] >= 0)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_normalisation_and_scaling(scoring_func, scaling, norm, device):
    args = dict(V2_LITE[1], scoring_func=scoring_func, norm_topk_prob=norm, routed_scaling_factor=scaling)
    weights, _ = _check(_inputs(5, 48, 64, torch.float32, device, seed=11), **args)
    if norm:
        torch.testing.assert_close(weights.sum(dim=1), torch.full_like(weights[:, 0], scaling))


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_deepseek_v3_experts(num_tokens, device):
    num_experts, args = V3
    _check(_inputs(num_tokens, 96, num_experts, torch.bfloat16, device, seed=12, bias=True, padded_rows=1), **args)


def test_bias_steers_choice_only(device):
    num_experts, args = V3_TINY
    x, gate, _, valid = _inputs(6, 64, num_experts, torch.float32, device, seed=13)
    # A large bias on one expert makes every token choose it, at its raw score.
    correction = torch.zeros(num_experts, device=device)
    correction[5] = 10.0
    weights, ids = _check((x, gate, correction, valid), **dict(args, norm_topk_prob=False, routed_scaling_factor=1.0))
    assert torch.all(ids[:, 0] == 5)
    torch.testing.assert_close(weights[:, 0], torch.sigmoid(x @ gate[5]))


@pytest.mark.parametrize("num_tokens, block_t, split_d, block_c", [(3, 4, 4, 0), (20, 8, 4, 16), (2, 2, 1, 16)])
@pytest.mark.parametrize("method", [V2_LITE, V2_GROUPED], ids=["greedy", "group_limited"])
def test_split_hidden(method, num_tokens, block_t, split_d, block_c, device):
    # D off every block multiple, split over several programs per tile, and E over tile columns.
    num_experts, args = method
    config = tri.RouteConfig(block_t=block_t, kernel_logits=True, block_d=32, split_d=split_d, block_c=block_c)
    _check(_inputs(num_tokens, 300, num_experts, torch.float32, device, seed=14, padded_rows=1), config, **args)


@pytest.mark.parametrize("num_tokens", [3, 20])
def test_logits_from_matmul_or_kernel(num_tokens, device):
    num_experts, args = V3_TINY
    inputs = _inputs(num_tokens, 64, num_experts, torch.bfloat16, device, seed=15, bias=True)
    for kernel_logits in (False, True):
        _check(inputs, tri.RouteConfig(block_t=4, kernel_logits=kernel_logits), **args)


def test_default_config_splits_wide_hidden(device):
    num_experts, args = V3
    config = tri.route_config(1, num_experts, 8, 8, 512)
    assert config.kernel_logits and (config.split_d > 1 or config.block_c < num_experts)  # several programs
    _check(_inputs(1, 512, num_experts, torch.float32, device, seed=15, bias=True), **args)


def test_uneven_groups(device):
    # 6 groups of 10 experts: each group's columns are padded to 16 inside the tile.
    args = dict(V2_GROUPED[1], n_group=6, topk_group=2)
    for num_tokens in (2, 9):
        _check(_inputs(num_tokens, 64, 60, torch.float32, device, seed=16), **args)
        _check(_inputs(num_tokens, 64, 60, torch.float32, device, seed=17, bias=True),
               **dict(args, scoring_func="sigmoid", topk_method="noaux_tc"))


@pytest.mark.parametrize("num_tokens", [3, 7])  # logits in the kernel, from a matmul
def test_non_contiguous_inputs(num_tokens, device):
    num_experts, args = V3_TINY
    x, gate, correction, valid = _inputs(num_tokens, 64, num_experts, torch.bfloat16, device, seed=16, bias=True,
                                         padded_rows=2)
    gen = generator(17, device)
    _check((strided(x, gen), strided(gate, gen), strided(correction, gen), strided(valid, gen)), **args)


@pytest.mark.parametrize("num_tokens", [1, 9])  # logits in the kernel, from a matmul
@pytest.mark.parametrize("method", [V2_LITE, V3_TINY], ids=["greedy", "noaux_tc"])
def test_shared_experts_follow_the_routed(method, num_tokens, device):
    num_experts, args = method
    inputs = _inputs(num_tokens, 64, num_experts, torch.float32, device, seed=20,
                     bias=args["topk_method"] == "noaux_tc", padded_rows=1)
    routed_weights, routed_ids = tri.route(*inputs, **args)
    weights, ids = tri.route(*inputs, **args, num_shared=2)
    expected_weights, expected_ids = ref.route(*inputs, **args, num_shared=2)
    k = args["top_k"]
    assert weights.shape == ids.shape == (num_tokens, k + 2)
    torch.testing.assert_close(weights[:, :k], routed_weights)       # the routed choice is unchanged
    assert torch.equal(ids[:, :k], routed_ids) and torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    valid = inputs[3]
    shared = torch.tensor([num_experts, num_experts + 1], device=device)
    assert torch.equal(ids[valid, k:], shared.expand(int(valid.sum()), 2))
    assert torch.all(weights[valid, k:] == 1.0)
    assert torch.all(ids[~valid] == -1) and torch.all(weights[~valid] == 0.0)


@pytest.mark.parametrize("num_tokens", [1, 9])  # logits in the kernel, from a matmul
@pytest.mark.parametrize("bias", [False, True])
def test_sqrtsoftplus_choice_and_shared_experts(num_tokens, bias, device):
    """DeepSeek-V4's score-routed layers: sqrt(softplus) scores, bias-steered top-k, a shared expert."""
    num_experts, args = V4_MINI
    inputs = _inputs(num_tokens, 64, num_experts, torch.float32, device, seed=23, bias=bias, padded_rows=1)
    weights, ids = tri.route(*inputs, **args, num_shared=1)
    expected_weights, expected_ids = ref.route(*inputs, **args, num_shared=1)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    valid = inputs[3]
    # Normalised to sum 1 before the scaling: the routed weights of a row sum to the factor.
    torch.testing.assert_close(weights[valid, :6].sum(dim=1), torch.full((int(valid.sum()),), 1.5, device=device))


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fixed_ids_take_their_scores(num_tokens, dtype, device):
    """DeepSeek-V4's hash-routed layers: the experts come from the token id; their scores weigh them."""
    num_experts, args = V4_MINI
    x, gate, bias, valid = _inputs(num_tokens, 64, num_experts, torch.float32, device, seed=24, padded_rows=1)
    gen = generator(25, device)
    fixed = torch.stack([torch.randperm(num_experts, generator=gen, device=device)[:6]
                         for _ in range(num_tokens)]).to(dtype)
    weights, ids = tri.route(x, gate, bias, valid, **args, num_shared=1, fixed_ids=fixed)
    expected_weights, expected_ids = ref.route(x, gate, bias, valid, **args, num_shared=1, fixed_ids=fixed)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    assert torch.equal(ids[valid, :6], fixed[valid].long())
    scores = torch.nn.functional.softplus(x @ gate.T).sqrt().gather(1, fixed.long())
    want = scores / scores.sum(dim=1, keepdim=True) * 1.5
    torch.testing.assert_close(weights[valid, :6], want[valid])
    assert torch.all(ids[~valid] == -1) and torch.all(weights[~valid] == 0.0)


@pytest.mark.parametrize("num_tokens", [1, 9, 40])  # logits in the kernel, from a matmul
@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("method", [V2_LITE, V3_TINY], ids=["greedy", "noaux_tc"])
def test_held_experts_renumber_the_choice_and_deal_the_shared_rows(method, rank, num_tokens, device):
    """An expert-parallel rank of 3 (each holding a quarter of the experts, so some choices fall on experts
    no rank here holds): the chosen experts it holds numbered among its own with the whole choice's
    weights, every other -1 and weight 0; the shared experts after its own, on rows t % 3 == rank only."""
    num_experts, args = method
    per_rank, k, ranks = num_experts // 4, args["top_k"], 3  # 3 ranks holding a quarter each: one quarter unheld
    held = HeldExperts(first=rank * per_rank, count=per_rank, rank=rank, ranks=ranks)
    inputs = _inputs(num_tokens, 64, num_experts, torch.float32, device, seed=26,
                     bias=args["topk_method"] == "noaux_tc", padded_rows=1)
    all_weights, all_ids = ref.route(*inputs, **args, num_shared=2)
    weights, ids = tri.route(*inputs, **args, num_shared=2, held=held)
    expected_weights, expected_ids = ref.route(*inputs, **args, num_shared=2, held=held)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    mine = (all_ids[:, :k] >= held.first) & (all_ids[:, :k] < held.first + per_rank)
    assert torch.equal(ids[:, :k], torch.where(mine, all_ids[:, :k] - held.first, -1))
    torch.testing.assert_close(weights[:, :k], torch.where(mine, all_weights[:, :k], 0.0))
    valid = inputs[3]
    rows = torch.arange(num_tokens, device=device)
    takes_shared = valid & (rows % ranks == rank)
    shared = torch.tensor([per_rank, per_rank + 1], device=device)
    assert torch.equal(ids[:, k:], torch.where(takes_shared[:, None], shared, -1))
    assert torch.equal(weights[:, k:], takes_shared[:, None].float().expand(-1, 2))


@pytest.mark.parametrize("num_tokens", [3, 70])  # one row tile, two (ROW_TILE rows a tile)
def test_held_experts_in_the_batch_invariant_tables(num_tokens, device):
    """The invariant tables' route takes `held` alike: the shared rows are counted on the whole batch,
    not a tile's."""
    num_experts, args = V2_LITE
    held = HeldExperts(first=16, count=16, rank=1, ranks=2)
    inputs = _inputs(num_tokens, 64, num_experts, torch.float32, device, seed=27, padded_rows=1)
    expected_weights, expected_ids = ref.route(*inputs, **args, num_shared=2, held=held)
    weights, ids = ref_invariant.route(*inputs, **args, num_shared=2, held=held)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    weights, ids = tri_invariant.invariant_route(*inputs, **args, num_shared=2, held=held)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights)


def test_held_experts_refuse_bad_values(device):
    num_experts, args = V2_LITE
    inputs = _inputs(2, 64, num_experts, torch.float32, device, seed=28)
    with pytest.raises(ValueError, match=r"held: experts \[60, 68\)"):
        tri.route(*inputs, **args, held=HeldExperts(first=60, count=8))
    with pytest.raises(ValueError, match=r"held: experts \[60, 68\)"):
        ref.route(*inputs, **args, held=HeldExperts(first=60, count=8))
    with pytest.raises(ValueError, match="rank=2, ranks=2"):
        HeldExperts(first=0, count=8, rank=2, ranks=2)
    with pytest.raises(ValueError, match="count=0"):
        HeldExperts(first=0, count=0)
    with pytest.raises(ValueError, match="HeldExperts.first: expected an int"):
        HeldExperts(first=1.5, count=8)


def test_no_tokens(device):
    num_experts, args = V2_LITE
    weights, ids = tri.route(*_inputs(0, 64, num_experts, torch.float32, device, seed=18), **args)
    assert weights.shape == (0, 6) and ids.shape == (0, 6)


def test_rejects_bad_inputs(device):
    num_experts, args = V2_GROUPED
    x, gate, correction, valid = _inputs(2, 64, num_experts, torch.float32, device, seed=19)
    with pytest.raises(ValueError, match="x: .*float64"):
        tri.route(x.double(), gate, correction, valid, **args)
    with pytest.raises(ValueError, match="gate"):
        tri.route(x, gate[:, :32], correction, valid, **args)
    with pytest.raises(ValueError, match="valid"):
        tri.route(x, gate, correction, valid.int(), **args)
    with pytest.raises(ValueError, match="n_group"):
        tri.route(x, gate, correction, valid, **dict(args, n_group=7))
    with pytest.raises(ValueError, match="topk_method"):
        tri.route(x, gate, correction, valid, **dict(args, topk_method="top2"))
    with pytest.raises(ValueError, match="topk_group"):
        tri.route(x, gate, correction, valid, **dict(args, topk_group=9))
    with pytest.raises(ValueError, match="num_shared"):
        tri.route(x, gate, correction, valid, **args, num_shared=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 2048])
@pytest.mark.parametrize("model", ["v2_lite", "v3"])
def test_gpu_real_sizes(model, num_tokens):
    device = torch.device("cuda")
    (num_experts, args), hidden = (V2_LITE, 2048) if model == "v2_lite" else (V3, 7168)
    inputs = _inputs(num_tokens, hidden, num_experts, torch.bfloat16, device, seed=num_tokens,
                     bias=model == "v3", padded_rows=1 if num_tokens > 1 else 0)
    # Among thousands of random rows a few hold two experts within float32
    # rounding of each other (seen: 1 of 2048 rows for V3), which either order
    # settles; they may differ from the float64 truth.
    _check(inputs, max_flipped_rows=num_tokens // 500, **args)


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_tokens():
    device = torch.device("cuda")
    num_experts, args = V3
    x, gate, correction, valid = _inputs(1, 7168, num_experts, torch.bfloat16, device, seed=20, bias=True)
    tri.route(x, gate, correction, valid, **args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = tri.route(x, gate, correction, valid, **args)
    for seed in (21, 22, 23):
        x.copy_(_inputs(1, 7168, num_experts, torch.bfloat16, device, seed=seed)[0])
        graph.replay()
        expected_weights, expected_ids = ref.route(x.double(), gate.double(), correction.double(), valid, **args)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights.double(), expected_weights, rtol=1e-5, atol=1e-7)
