"""The MoE block (routed + shared experts) against transformers' own MoE module.

Decode-sized steps run the shared experts inside the fused MoE call; larger
steps run them as dense GEMMs. Both must compute transformers' block, with one
shared expert (V3) and with two (V2-Lite), whose MLP the params cut into slices.
"""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from mla_func.kernels import ops_for
from mla_func.models.mla.moe import (NARROW_SUMS_MIN_TOKENS, SHARED_IN_FUSED_MAX_TOKENS, moe, route, shared_experts,
                                     sum_dtype)
from mla_func.models.mla.params import MoEParams
from support.mla_reference import make_reference, rel_err, save_reference

# transformers routes in float32 even in a float64 model, which bounds the agreement.
TOL = 1e-6


@pytest.fixture(scope="module", params=[("v2-greedy", 2), ("v3-qlora-noaux", 1)], ids=["v2-2shared", "v3-1shared"])
def pair(request, tmp_path_factory):
    variant, num_shared = request.param
    reference = make_reference(variant, dtype=torch.float64, seed=7, n_shared_experts=num_shared)
    path = save_reference(reference, tmp_path_factory.mktemp(variant))
    return reference, mf.load_model(path, dtype=torch.float64, device="cpu")


@pytest.mark.parametrize("num_tokens", [3, SHARED_IN_FUSED_MAX_TOKENS, SHARED_IN_FUSED_MAX_TOKENS + 1, 40])
def test_moe_block_matches_transformers(pair, num_tokens):
    reference, model = pair
    layer = 1                                                        # layer 0 is dense
    p = model.params.layers[layer].mlp
    assert isinstance(p, MoEParams) and p.num_shared == model.config.n_shared_experts
    x = torch.randn(num_tokens, model.config.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(num_tokens))
    valid = torch.ones(num_tokens, dtype=torch.bool)
    with torch.no_grad():
        want = reference.model.layers[layer].mlp(x[None])[0]
    got = moe(p, x, valid, model.config, ops_for("torch"))
    assert rel_err(got, want) < TOL


def test_fused_and_dense_shared_experts_agree(pair):
    _, model = pair
    p, ops, config = model.params.layers[1].mlp, ops_for("torch"), model.config
    x = torch.randn(5, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    valid = torch.ones(5, dtype=torch.bool)
    weights, ids = route(p, x, valid, config, ops, num_shared=p.num_shared)
    fused = ops.moe.fused_moe(x, p.w13, p.w2, weights, ids)
    weights, ids = route(p, x, valid, config, ops)
    dense = ops.moe.fused_moe(x, p.w13[:p.num_routed], p.w2[:p.num_routed], weights, ids) + shared_experts(p, x)
    assert rel_err(fused, dense) < 1e-12


def test_padded_rows_take_no_expert(pair):
    _, model = pair
    p = model.params.layers[1].mlp
    x = torch.randn(6, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    valid = torch.tensor([True, True, True, True, False, False])
    out = moe(p, x, valid, model.config, ops_for("torch"))
    assert torch.all(out[4:] == 0)
    torch.testing.assert_close(out[:4], moe(p, x[:4], valid[:4], model.config, ops_for("torch")))


def test_export_rebuilds_the_shared_mlp(pair):
    reference, model = pair
    from mla_func.demo.export import params_to_hf

    tensors = params_to_hf(model.params)
    for name, want in reference.state_dict().items():
        if "shared_experts" in name or "q_proj" in name or "kv_a_proj" in name or "q_a_proj" in name:
            assert torch.equal(tensors[name], want), name


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("num_tokens", [1, 7, SHARED_IN_FUSED_MAX_TOKENS + 3])
def test_expert_parallel_ranks_partial_sums_add_up_to_the_block(pair, num_tokens, ranks):
    """Each expert-parallel rank's block as `expert_shard` holds it (its routed experts whole, every shared
    expert whole, `held` saying which): its partial sum takes its own routed experts' share of every token
    and the shared experts of its rows only, so the ranks' sums add up to the whole block, above the size
    where one process takes the dense shared GEMMs too; a padded row takes nothing on any rank."""
    from mla_func.kernels.held_experts import HeldExperts
    from mla_func.models.expert_parallel import expert_range

    _, model = pair
    p, config, ops = model.params.layers[1].mlp, model.config, ops_for("torch")
    x = torch.randn(num_tokens, config.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(num_tokens))
    valid = torch.ones(num_tokens, dtype=torch.bool)
    valid[-1] = num_tokens == 1  # a padded last row, but for the one-row step
    whole = moe(p, x, valid, config, ops)
    shared = slice(p.num_routed, p.num_routed + p.num_shared)
    partials = []
    for rank in range(ranks):
        held = expert_range(config, rank, ranks)
        keep = torch.cat([torch.arange(held.start, held.stop), torch.arange(shared.start, shared.stop)])
        share = MoEParams(gate=p.gate, w13=p.w13[keep], w2=p.w2[keep], e_score_correction_bias=p.e_score_correction_bias,
                          held=HeldExperts(first=held.start, count=len(held), rank=rank, ranks=ranks))
        assert share.num_routed == len(held) and share.num_shared == p.num_shared
        partials.append(moe(share, x, valid, config, ops))
    # (One process's dense shared GEMMs, above SHARED_IN_FUSED_MAX_TOKENS, also fill padded rows, which
    # no one reads: the real rows are the block's.)
    assert rel_err(sum(partials)[valid], whole[valid]) < 1e-12
    assert all(torch.all(part[~valid] == 0) for part in partials)


def _two_ranks(ops):
    """`ops` as rank 0 of two would hold them (the sums themselves are not called here)."""
    import dataclasses

    def refused(*args, **kwargs):
        raise AssertionError("sum_dtype calls no collective")

    return dataclasses.replace(ops, collectives=dataclasses.replace(
        ops.collectives, size=2, all_reduce=refused, all_gather=refused, reduce_scatter=refused))


@pytest.mark.parametrize("num_tokens", [1, NARROW_SUMS_MIN_TOKENS - 1, NARROW_SUMS_MIN_TOKENS, 256])
def test_partial_sums_cross_the_wire_in_the_model_dtype_from_enough_rows(num_tokens):
    """One process keeps the MoE's output in float32 (the residual add rounds once); a sharded rank's
    partial sum goes out in bf16 from NARROW_SUMS_MIN_TOKENS rows, float32 below (and float64 stays
    float64); a batch-invariant table keeps float32 at every size."""
    single, invariant = ops_for("torch"), ops_for("torch", batch_invariant=True)
    x = torch.zeros(num_tokens, 8, dtype=torch.bfloat16)
    assert sum_dtype(x, single) == torch.float32
    narrow = num_tokens >= NARROW_SUMS_MIN_TOKENS
    assert sum_dtype(x, _two_ranks(single)) == (torch.bfloat16 if narrow else torch.float32)
    assert sum_dtype(x, _two_ranks(invariant)) == torch.float32
    assert sum_dtype(x.double(), _two_ranks(single)) == torch.float64


def test_a_ranks_partial_sum_in_bf16_is_the_same_sum(pair):
    """From NARROW_SUMS_MIN_TOKENS rows a rank's block returns its sum in bf16: one process's float32
    sum to bf16's precision (the reference weights and adds the experts in the output's dtype)."""
    _, model = pair
    p = model.params.layers[1].mlp
    bias = None if p.e_score_correction_bias is None else p.e_score_correction_bias.float()
    p = MoEParams(gate=p.gate.float(), w13=p.w13.bfloat16(), w2=p.w2.bfloat16(), e_score_correction_bias=bias)
    num_tokens = NARROW_SUMS_MIN_TOKENS + 2
    x = torch.randn(num_tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    valid = torch.ones(num_tokens, dtype=torch.bool)
    ops = ops_for("torch")
    wide = moe(p, x, valid, model.config, ops)
    narrow = moe(p, x, valid, model.config, _two_ranks(ops))
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    torch.testing.assert_close(narrow.float(), wide, rtol=1.6e-2, atol=1e-2)
