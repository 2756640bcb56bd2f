"""A state with FP8 latent caches (`init_state(kv_cache_dtype="fp8")`): its leaves and bytes, the checks,
donation, and the forward on both backends over it."""

from __future__ import annotations

import pytest
import torch

import mla_func as mf
from support.hand_plans import blocks
from mla_func.core.prepare import state_bytes_per_block
from mla_func.kernels.latent_cache import FP8LatentCache
from mla_func.models.presets import v2_lite, v32_lite
from mla_func.serving.engine_config import default_num_blocks

BLOCK_SIZE = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model():
    return mf.load_model("tiny", dtype=torch.float32, device="cpu", seed=31)


def test_leaves_are_one_byte_a_latent_value(model):
    c = model.config
    state = mf.init_state(model, num_blocks=10, block_size=BLOCK_SIZE, kv_cache_dtype="fp8")
    groups = -(-c.kv_lora_rank // 128)
    for layer in state.layers:
        kv = layer.kv
        assert isinstance(kv, FP8LatentCache)
        assert kv.values.dtype == torch.float8_e4m3fn and kv.values.element_size() == 1
        assert kv.values.shape == (10, BLOCK_SIZE, c.kv_lora_rank)
        assert kv.scales.dtype == torch.float32 and kv.scales.shape == (10, BLOCK_SIZE, groups)
        assert kv.rope.dtype == model.dtype and kv.rope.shape == (10, BLOCK_SIZE, c.qk_rope_head_dim)
    assert state.dtype == model.dtype                    # the activations' dtype, which the forward checks
    per_token = c.kv_lora_rank * 1 + groups * 4 + c.qk_rope_head_dim * 4
    want = c.num_hidden_layers * BLOCK_SIZE * per_token
    assert state.bytes_per_block() == state_bytes_per_block(model, BLOCK_SIZE, "fp8") == want
    assert len(state.leaves()) == 3 * c.num_hidden_layers


@pytest.mark.parametrize("config, indexer, fp8_indexer", [(v2_lite, 0, 0), (v32_lite, 128 * 2, 128 + 4)],
                         ids=["v2-lite", "v3.2-lite"])
def test_real_sizes_take_656_bytes_a_token_and_layer(config, indexer, fp8_indexer):
    """DeepSeek's latent (512 + 64) in bf16: 512 FP8 values, 4 float32 scales, 64 bf16 RoPE values; V3.2's
    indexer keys (128) in FP8: 128 values and a float32 scale, against 128 bf16 values."""
    c = config()
    state = mf.init_state(c, num_blocks=2, block_size=64, dtype=torch.bfloat16, device="meta", kv_cache_dtype="fp8")
    assert state.bytes_per_block() == c.num_hidden_layers * 64 * (656 + fp8_indexer)
    auto = mf.init_state(c, num_blocks=2, block_size=64, dtype=torch.bfloat16, device="meta")
    assert auto.bytes_per_block() == c.num_hidden_layers * 64 * (1152 + indexer)


def test_engine_budget_counts_the_fp8_bytes(model):
    """With more sequences wanted than memory holds, the block count is the budget over a block's bytes."""
    many = dict(block_size=16, max_num_seqs=10 ** 9, max_model_len=model.config.max_position_embeddings)
    auto = default_num_blocks(model, many["block_size"], many["max_num_seqs"], many["max_model_len"])
    fp8 = default_num_blocks(model, many["block_size"], many["max_num_seqs"], many["max_model_len"],
                             kv_cache_dtype="fp8")
    ratio = state_bytes_per_block(model, 16) / state_bytes_per_block(model, 16, "fp8")
    assert abs(fp8 / auto - ratio) < 1e-3


def test_bad_and_unsupported_cache_dtypes_are_refused(model):
    with pytest.raises(ValueError, match="kv_cache_dtype.*'bf16'"):
        mf.init_state(model, num_blocks=4, kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match="Engine: kv_cache_dtype.*'fp8_e5m2'"):
        mf.Engine(model, num_blocks=4, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="layers"):
        mf.init_state(model, num_blocks=4, kv_cache_dtype="fp8", layers=mf.layer_kinds(model.config))


def _plans():
    return [
        mf.StepPlan(prefill=(mf.SeqPlan(tuple(range(3, 24)), 0, blocks(0, 8), 21),
                             mf.SeqPlan((9, 8, 7), 0, blocks(1, 8), 3))),
        mf.StepPlan(prefill=(mf.SeqPlan((40, 41, 42), 3, blocks(1, 8), 3),),
                    decode=(mf.SeqPlan((50,), 21, blocks(0, 8)),)),
        mf.StepPlan(decode=(mf.SeqPlan((51,), 22, blocks(0, 8)), mf.SeqPlan((43,), 6, blocks(1, 8)))),
    ]


def _run(model, state, backend):
    outs = []
    for plan in _plans():
        batch, mode = mf.plan_step(model.config, state, plan, backend=backend)
        logits, state = mf.forward(model.params, state, batch, mode)
        outs.append(logits[: mode.num_logits])
    return torch.cat(outs), state


def test_copy_keeps_the_fp8_state_and_inplace_donates_it(model):
    state = mf.init_state(model, num_blocks=20, block_size=BLOCK_SIZE, kv_cache_dtype="fp8")
    batch, mode = mf.plan_step(model.config, state, _plans()[0])
    _, kept = mf.forward(model.params, state, batch, mode, copy=True)
    assert not state.is_donated and not any(leaf.view(torch.uint8).any() for leaf in state.leaves())
    _, new = mf.forward(model.params, state, batch, mode)
    assert state.is_donated
    for a, b in zip(new.leaves(), kept.leaves()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_triton_forward_over_fp8_state_matches_the_reference():
    """Prefill, mixed and decode steps over an FP8 state: both backends write and read the same cache."""
    model = mf.load_model("tiny", dtype=torch.float32, device=DEVICE, seed=31)

    def fresh():
        return mf.init_state(model, num_blocks=20, block_size=BLOCK_SIZE, kv_cache_dtype="fp8")

    want, want_state = _run(model, fresh(), "torch")
    got, got_state = _run(model, fresh(), "triton")
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    # Block 0 is scratch: the reference parks padded rows there, the kernels write nothing.
    for g, w in zip(got_state.layers, want_state.layers):
        torch.testing.assert_close(g.kv.scales[1:], w.kv.scales[1:], rtol=1e-5, atol=0)
