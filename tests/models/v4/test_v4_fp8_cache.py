"""DeepSeek-V4 with FP8 caches (`kv_cache_dtype="fp8"`): its leaves and bytes, the engine near the 16-bit
caches', and the Triton table reading them as the torch table does.

The window keys and compressed entries are `FP8LatentCache`s (the Dh - R leading values of a key in e4m3
with a float32 scale a group of 128, its R rotated values as they are), CSA's indexer keys an
`FP8IndexCache`; the compressor inputs stay in the activations' dtype.

The model is transformers' random small V4 (`support.v4_reference`). Random weights make it a chaotic
function of its keys (the reason the V3 and V3.2 FP8-cache tests use the demo's trained weights, which
have no V4 counterpart): measured on the CPU in float32 over six prompts of 20 to 40 tokens, teacher-forced
logits rows differ from the fp32 caches' by a median 4.0% and a 90th percentile 10.5% of their largest
logit, and the next token they pick agrees at 91.8% of positions; running the same model with bf16
weights and caches instead moves them by 2.6% and 6.5%, and agrees at 96.5%. The bounds below leave room
over the FP8 figures; what they rule out is a cache read at the wrong scale or place (logits then differ
by the size of the logits). Each kernel's reading and writing of the FP8 forms is checked exactly against
the reference in `tests/kernels/test_v4_attention.py` and `test_v4_compress.py`.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mla_func as mf
from support.fp8_cache_cases import ENGINE_SETTINGS
from support.v4_reference import Seq, new_state, save_reference
from mla_func.kernels.index_cache import FP8IndexCache
from mla_func.kernels.latent_cache import FP8LatentCache
from mla_func.models.presets import v4_mini


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4-fp8-cache")
    save_reference(folder, seed=21)
    return mf.load_model(folder, device="cpu")


def test_fp8_state_holds_fp8_keys(model):
    c = model.config
    state = mf.init_state(model, num_blocks=6, block_size=16, kv_cache_dtype="fp8")
    auto = mf.init_state(model, num_blocks=6, block_size=16)
    rope, values = c.qk_rope_head_dim, c.family_fields.head_dim - c.qk_rope_head_dim
    for layer, plain in zip(state.layers, auto.layers):
        assert isinstance(layer.window, FP8LatentCache) and layer.window.values.element_size() == 1
        assert layer.window.values.shape[2] == values and layer.window.rope.shape[2] == rope
        assert layer.window.rope.dtype == model.dtype
        assert (layer.entries is None) == (plain.entries is None)
        if layer.entries is not None:
            assert isinstance(layer.entries, FP8LatentCache)
            assert layer.compressor_inputs.dtype == model.dtype
            assert layer.compressor_inputs.shape == plain.compressor_inputs.shape
        assert (layer.index_keys is None) == (plain.index_keys is None)
        if layer.index_keys is not None:
            assert isinstance(layer.index_keys, FP8IndexCache)
    assert state.dtype == model.dtype
    # A key: `values` bytes, a float32 scale (fewer than 128 values), `rope` float32 values; an index key:
    # Di bytes and a float32 scale.
    per_key_saved = 4 * (values + rope) - (values + 4 + 4 * rope)
    assert auto.bytes_per_block() - state.bytes_per_block() == c.num_hidden_layers * 16 * per_key_saved
    di = c.family_fields.index_head_dim
    for g in range(1, len(state.groups)):
        layers = [layer for layer in auto.layers if layer.entry_group == g]
        saved = sum(per_key_saved + (4 * di - (di + 4) if layer.index_keys is not None else 0) for layer in layers)
        assert auto.bytes_per_block(g) - state.bytes_per_block(g) == state.groups[g].block_size * saved


def test_real_size_keys_take_592_bytes():
    """V4's keys at their real size (v4-mini's, as V4-Flash's: Dh 512, R 64) in bf16: 448 FP8 values, 4 float32 scales, 64 bf16 rope
    values, against 1,024 bytes; the indexer's keys (128) 132 bytes against 256."""
    c = v4_mini()
    fp8 = mf.init_state(c, num_blocks=2, block_size=128, dtype=torch.bfloat16, device="meta", kv_cache_dtype="fp8")
    auto = mf.init_state(c, num_blocks=2, block_size=128, dtype=torch.bfloat16, device="meta")
    v = c.family_fields
    assert (v.head_dim, c.qk_rope_head_dim, v.index_head_dim) == (512, 64, 128)
    for f, a in zip(fp8.layers, auto.layers):
        assert sum(t[0, 0].numel() * t.element_size() for t in (f.window.values, f.window.scales, f.window.rope)) == 592
        assert a.window[0, 0].numel() * a.window.element_size() == 1024
        if f.index_keys is not None:
            assert f.index_keys.values[0, 0].numel() + 4 * f.index_keys.scales[0, 0].numel() == 132


def test_fp8_engine_stays_near_the_16_bit_caches(model):
    rng = random.Random(11)
    prompts = [[rng.randrange(2, model.config.vocab_size) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    auto = mf.Engine(model, **ENGINE_SETTINGS)
    fp8 = mf.Engine(model, **ENGINE_SETTINGS, kv_cache_dtype="fp8")
    errors, picks = [], []
    for p in prompts:
        a, b = auto.score(p), fp8.score(p)
        errors.append((a - b).abs().amax(-1) / a.abs().amax(-1))
        picks.append(a.argmax(-1) == b.argmax(-1))
    errors, picks = torch.cat(errors), torch.cat(picks)
    assert errors.median() <= 0.06 and errors.quantile(0.9) <= 0.16
    assert picks.float().mean() >= 0.85
    # Greedy generation runs on FP8 caches through decode steps and preemption-free scheduling alike.
    greedy = mf.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert all(len(c.raise_for_error().token_ids) == 8 for c in fp8.generate(prompts[:3], greedy))


def _fp8_steps(model: mf.Model, ops: mf.kernels.Ops) -> list[torch.Tensor]:
    """Logits of four steps over FP8 caches: an 18-token prompt (the window slides, CSA and HCA entries
    complete), a mixed step (a second prompt beside its first decode), two decode steps of both."""
    state = new_state(model, num_seqs=2, kv_cache_dtype="fp8")
    seqs = [Seq(i, state.groups, max_tokens=32) for i in range(2)]
    first, second = random.Random(5).choices(range(2, 97), k=18), random.Random(6).choices(range(2, 97), k=6)
    plans = [mf.StepPlan(prefill=(seqs[0].plan(first, 0),)),
             mf.StepPlan(prefill=(seqs[1].plan(second, 0),), decode=(seqs[0].plan([5], 18, 1),))]
    for step in range(2):
        plans.append(mf.StepPlan(decode=(seqs[0].plan([7 + step], 19 + step, 1), seqs[1].plan([9 + step], 6 + step, 1))))
    outputs = []
    for plan in plans:
        batch, mode = mf.plan_step(model.config, state, plan)
        logits, state = mf.forward(model.params, state, batch, mode, ops=ops)
        outputs.append(logits[: mode.num_logits])
    return outputs


def test_triton_cache_ops_read_fp8_caches_as_the_torch_ones(model):
    """The torch table with the Triton ops that write and read the caches swapped in (the window and entry
    writes, the indexer's scores, the attention): the same logits over FP8 caches (the Triton interpreter
    without a GPU). The whole Triton table on a V4 model is `test_v4_triton.py`'s."""
    torch_ops, triton_ops = mf.kernels.ops_for("torch"), mf.kernels.ops_for("triton")
    mixed = dataclasses.replace(
        torch_ops,
        mla=dataclasses.replace(torch_ops.mla, write_kv=triton_ops.mla.write_kv),
        dsa=dataclasses.replace(torch_ops.dsa, index_scores=triton_ops.dsa.index_scores),
        v4=dataclasses.replace(torch_ops.v4, window_entry_attention=triton_ops.v4.window_entry_attention,
                               compress_entries=triton_ops.v4.compress_entries))
    want, got = _fp8_steps(model, torch_ops), _fp8_steps(model, mixed)
    for w, g in zip(want, got):
        assert ((w - g).abs().amax(-1) / w.abs().amax(-1)).max() <= 1e-3
        assert torch.equal(w.argmax(-1), g.argmax(-1))


def test_a_family_without_fp8_caches_is_refused_by_name(model):
    family = dataclasses.replace(model.config.family, fp8_cache_layer_kinds=None)
    config = dataclasses.replace(model.config, family=family)
    with pytest.raises(ValueError, match="DeepSeek-V4 models have no FP8 latent cache"):
        mf.init_state(config, num_blocks=4, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
