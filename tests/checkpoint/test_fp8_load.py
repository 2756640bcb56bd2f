"""DeepSeek's FP8 checkpoints load as they ship and run on FP8 pairs, against transformers on the
dequantized weights.

The FP8 folders are written by independent code (`support.fp8_official`), not by mla-func's
converter, from fresh random tiny models whose dimensions are not multiples of 128 (partial
blocks at the bottom and right edges, block boundaries inside the projections mla-func joins).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import mla_func as mf
from mla_func.checkpoint.files import CheckpointError
from mla_func.core.config import ConfigError
from mla_func.kernels.quantized import BlockFP8Weight
from mla_func.models.memory import params_bytes
from mla_func.models.mla.params import MoEParams
from mla_func.models.presets import PRESETS
from mla_func.models.random_weights import random_params
from mla_func.pytree import tree_leaves
from support.dsa_reference import MIN_RELATIVE_GAP, make_v32, smallest_top_k_gap
from support.fp8_official import write_fp8_checkpoint
from support.hand_plans import Seq, blocks, decode_plan, prefill_in_chunks, prefill_plan, run
from support.mla_reference import make_reference, reference_logits, rel_err

BLOCK_SIZE = 4
PROMPT = 19
DECODE_STEPS = 5
TOL = 1e-4        # against transformers in float32 (as tests/models/mla/test_hf_parity.py)
SELF_TOL = 1e-5   # between mla-func's own paths
DRAWS = 20        # fresh token draws before a test gives up on finding one clear of index-score ties
T = TypeVar("T")

# Dimensions past one block and not multiples of 128.
WIDE = dict(vocab_size=97, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, q_lora_rank=144,
            kv_lora_rank=136, num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=40, qk_rope_head_dim=8,
            v_head_dim=56, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)


def _v3(seed: int) -> torch.nn.Module:
    # Two shared experts: mla-func cuts the shared MLP at column 136, inside a block.
    return make_reference("v3-qlora-noaux", seed=seed, **WIDE, n_shared_experts=2, n_group=2, topk_group=1,
                          num_hidden_layers=2)


def _v32(seed: int) -> torch.nn.Module:
    return make_v32(seed=seed, **WIDE, n_shared_experts=1, index_n_heads=9, index_head_dim=16, index_topk=8)


MODELS = {"v3": _v3, "v32": _v32}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    """(transformers on the dequantized weights, mla-func on the FP8 folder, the FP8 folder)."""
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    MODELS[request.param](random.randrange(1000)).save_pretrained(root / "float")
    quantized = write_fp8_checkpoint(root / "float", root / "fp8", root / "dequantized")
    assert len(quantized) > 10
    oracle = AutoModelForCausalLM.from_pretrained(root / "dequantized", dtype=torch.float32,
                                                  attn_implementation="eager", experts_implementation="eager").eval()
    return oracle, mf.load_model(root / "fp8", dtype=torch.float32, device="cpu"), root / "fp8"


def _state(model: mf.Model) -> mf.KVCacheState:
    return mf.init_state(model.config, num_blocks=48, block_size=BLOCK_SIZE, dtype=model.dtype)


def _tokens(n: int, vocab: int) -> list[int]:
    rng = random.Random()
    return [rng.randrange(vocab) for _ in range(n)]


def _clear_of_ties(model: mf.Model, tokens: list[int]) -> bool:
    """True unless V3.2's indexer has a near-tie at the k-th score of some query of `tokens`: there two
    correct implementations (mla-func over FP8 pairs, transformers over their dequantized values) may
    attend to different keys, and the logits differ by far more than rounding."""
    return not model.config.has_indexer or smallest_top_k_gap(model, tokens, BLOCK_SIZE)[0] >= MIN_RELATIVE_GAP


def _on_fresh_tokens(model: mf.Model, attempt: Callable[[], tuple[T, list[list[int]]]]) -> T:
    """`attempt()` -> (its result, the token lists it ran), retried on fresh tokens until every list is
    clear of index-score ties. A list covers its prefixes: a query's scores depend on earlier tokens only."""
    for _ in range(DRAWS):
        result, ran = attempt()
        if all(_clear_of_ties(model, tokens) for tokens in ran):
            return result
    pytest.fail(f"{DRAWS} fresh draws in a row had a near-tie at the k-th index score")


def _prompt(model: mf.Model, n: int) -> list[int]:
    """n fresh random tokens clear of index-score ties."""
    def attempt() -> tuple[list[int], list[list[int]]]:
        tokens = _tokens(n, model.config.vocab_size)
        return tokens, [tokens]
    return _on_fresh_tokens(model, attempt)


def test_projections_stay_fp8_pairs(pair):
    _, model, _ = pair
    layer = model.params.layers[1]
    a = layer.attn
    for weight in (a.qkv_a_proj, a.q_b_proj, a.w_uk, a.w_uv, a.o_proj, layer.mlp.w13, layer.mlp.w2):
        assert isinstance(weight, BlockFP8Weight)
        assert weight.values.dtype == torch.float8_e4m3fn and weight.scale_inv.dtype == torch.float32
    # kv_b_proj per head: heads of 40 + 56 rows inside 128-row blocks keep their scales on blocks of 8 rows.
    c = model.config
    assert a.w_uk.shape == (c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank)
    assert a.w_uv.shape == (c.num_attention_heads, c.v_head_dim, c.kv_lora_rank)
    assert a.w_uk.block == a.w_uv.block == (8, 128)
    assert isinstance(model.params.layers[0].mlp.gate_up, BlockFP8Weight)
    assert model.params.embed.dtype == torch.float32


def test_prefill_matches_transformers(pair):
    oracle, model, _ = pair
    tokens = _prompt(model, PROMPT)
    got, _ = prefill_in_chunks(model, _state(model), Seq(blocks(0, 8)), tokens, chunk=PROMPT)
    assert rel_err(got, reference_logits(oracle, tokens)) <= TOL


@pytest.mark.parametrize("chunk", [1, 6])
def test_chunked_prefill_matches_transformers(pair, chunk):
    oracle, model, _ = pair
    tokens = _prompt(model, PROMPT)
    got, _ = prefill_in_chunks(model, _state(model), Seq(blocks(0, 8)), tokens, chunk=chunk)
    assert rel_err(got, reference_logits(oracle, tokens)) <= TOL


def test_decode_matches_transformers_and_greedy_tokens_agree(pair):
    oracle, model, _ = pair

    def greedy() -> tuple[tuple[list[int], torch.Tensor], list[list[int]]]:
        prompt = _tokens(PROMPT, model.config.vocab_size)
        seq = Seq(blocks(0, 8))
        got, state = prefill_in_chunks(model, _state(model), seq, prompt, chunk=PROMPT)
        tokens, rows = list(prompt), [got]
        for _ in range(DECODE_STEPS):   # greedy: each step feeds mla-func's own argmax
            tokens.append(int(rows[-1][-1].argmax()))
            logits, state = run(model, state, mf.StepPlan(decode=(decode_plan(seq, tokens[-1]),)))
            seq.cached += 1
            rows.append(logits)
        return (tokens, torch.cat(rows)), [tokens]

    tokens, got = _on_fresh_tokens(model, greedy)
    want = reference_logits(oracle, tokens)
    assert rel_err(got[PROMPT:], want[PROMPT:]) <= TOL
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_mixed_step_matches_transformers(pair):
    oracle, model, _ = pair
    vocab = model.config.vocab_size

    def draw() -> tuple[tuple[list[list[int]], list[int]], list[list[int]]]:
        prompts, nxt = [_tokens(n, vocab) for n in (9, 5, 13)], _tokens(2, vocab)
        return (prompts, nxt), [prompts[0] + nxt[:1], prompts[1] + nxt[1:], prompts[2]]

    prompts, nxt = _on_fresh_tokens(model, draw)
    seqs = [Seq(blocks(i, 8)) for i in range(3)]
    state = _state(model)
    _, state = run(model, state, mf.StepPlan(prefill=tuple(prefill_plan(seqs[i], prompts[i], all_logits=False)
                                                           for i in (0, 1))))
    for i in (0, 1):
        seqs[i].cached = len(prompts[i])
    plan = mf.StepPlan(prefill=(prefill_plan(seqs[2], prompts[2]),),
                       decode=tuple(decode_plan(seqs[i], nxt[i]) for i in (0, 1)))
    batch, mode = mf.plan_step(model.config, state, plan)
    assert mode.kind == "mixed"
    logits, _ = mf.forward(model.params, state, batch, mode)
    assert rel_err(logits[:13], reference_logits(oracle, prompts[2])) <= TOL
    for row, i in ((13, 0), (14, 1)):
        assert rel_err(logits[row], reference_logits(oracle, prompts[i] + [nxt[i]])[-1]) <= TOL


def test_the_engine_decodes_greedily_as_transformers(pair):
    oracle, model, _ = pair

    def oracle_greedy() -> tuple[list[int], list[list[int]]]:
        tokens = _tokens(7, model.config.vocab_size)
        for _ in range(6):
            tokens.append(int(reference_logits(oracle, tokens)[-1].argmax()))
        return tokens, [tokens]

    tokens = _on_fresh_tokens(model, oracle_greedy)
    got = mf.Engine(model, block_size=BLOCK_SIZE).generate(
        [tokens[:7]], mf.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    assert list(got) == tokens[7:]


def _copy_with(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


SCALE = "model.layers.1.self_attn.o_proj.weight_scale_inv"


@pytest.mark.parametrize("case", ["shape", "nan", "zero", "dtype", "missing", "extra"])
def test_a_malformed_scale_is_refused_by_name(pair, tmp_path, case):
    _, _, folder = pair

    def edit(t: dict[str, torch.Tensor]) -> None:
        if case == "shape":
            t[SCALE] = t[SCALE][:1].contiguous()
        elif case == "nan":
            t[SCALE][0, 0] = float("nan")
        elif case == "zero":
            t[SCALE][-1, -1] = 0.0
        elif case == "dtype":
            t[SCALE] = t[SCALE].to(torch.bfloat16)
        elif case == "missing":
            del t[SCALE]
        else:
            t["model.layers.1.input_layernorm.weight_scale_inv"] = torch.ones(1, 2)

    bad = _copy_with(folder, tmp_path / "bad", edit)
    name = "model.layers.1.input_layernorm.weight_scale_inv" if case == "extra" else SCALE
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        mf.load_model(bad, dtype=torch.float32, device="cpu")


def test_a_quantized_weight_stored_wide_is_refused_by_name(pair, tmp_path):
    _, _, folder = pair
    weight = SCALE.removesuffix("_scale_inv")

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[weight] = t[weight].float()

    with pytest.raises(CheckpointError, match=weight.replace(".", r"\.") + ".*F8_E4M3"):
        mf.load_model(_copy_with(folder, tmp_path / "bad", edit), dtype=torch.float32, device="cpu")


def test_another_quantization_config_is_refused(pair, tmp_path):
    _, _, folder = pair
    bad = _copy_with(folder, tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantization_config"):
        mf.load_model(bad, dtype=torch.float32, device="cpu")


def _pairs(model: mf.Model) -> list[BlockFP8Weight]:
    """Every layer's attention and MLP pairs (`test_projections_stay_fp8_pairs`' list, the dense MLP's too)."""
    pairs = []
    for layer in model.params.layers:
        a = layer.attn
        pairs += [a.qkv_a_proj, a.q_b_proj, a.w_uk, a.w_uv, a.o_proj]
        pairs += [layer.mlp.w13, layer.mlp.w2] if isinstance(layer.mlp, MoEParams) else [layer.mlp.gate_up, layer.mlp.down]
    assert all(isinstance(w, BlockFP8Weight) for w in pairs)
    return pairs


def test_scale_fmt_ue8m0_reaches_every_pair_and_the_w8a8_products(pair, tmp_path):
    """A quantization_config with `scale_fmt: ue8m0` (V3.1 and later): every pair's w8a8 products round the
    activations' scales up to powers of two, as DeepSeek's own code does; without it they keep them as they fall.
    The dequantized-weight math (the default) does not read the field."""
    _, model, folder = pair
    ue8m0 = _copy_with(folder, tmp_path / "ue8m0", lambda t: None)
    config = json.loads((ue8m0 / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (ue8m0 / "config.json").write_text(json.dumps(config))
    rounded = mf.load_model(ue8m0, dtype=torch.float32, device="cpu")
    assert {w.activation_scale_fmt for w in _pairs(model)} == {"fp32"}
    assert {w.activation_scale_fmt for w in _pairs(rounded)} == {"ue8m0"}

    def logits(m: mf.Model, w8a8: bool) -> torch.Tensor:
        step = mf.make_step(m, w8a8=w8a8)
        state = _state(m)
        tokens = list(range(3, 3 + PROMPT))
        batch, mode = step.prepare(state, mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), 0, blocks(0, 6),
                                                                          len(tokens)),)))
        return step(state, batch, mode)[1].logits

    assert torch.equal(logits(model, False), logits(rounded, False))
    # (How close each stays to the dequantized-weight logits is the ops' tests' business: on these random tiny
    # models a routing or top-k flip moves whole rows either way.)
    assert not torch.equal(logits(model, True), logits(rounded, True))


def test_a_float_folder_refuses_quantization_fp8(tmp_path):
    make_reference("v3-qlora-noaux", seed=1).save_pretrained(tmp_path / "float")
    with pytest.raises(CheckpointError, match="as it is stored"):
        mf.load_model(tmp_path / "float", quantization="fp8", device="cpu")


def test_a_v3_shaped_layer_holds_one_byte_a_value_plus_scales():
    """DeepSeek-V3's layer shapes (four routed experts instead of 256, to fit a test machine): every
    projection, kv_b_proj's per-head W_UK and W_UV included, is one byte a value plus float32 scales,
    whose bytes are under 1% of the values', and the memory estimate is what the params hold."""
    v3 = dataclasses.replace(PRESETS["v2-lite"](), model_type="deepseek_v3", hidden_size=7168, q_lora_rank=1536,
                             num_attention_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             kv_lora_rank=512, moe_intermediate_size=2048, intermediate_size=4096,
                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=2,
                             first_k_dense_replace=1, vocab_size=256, eos_token_ids=(1,), n_group=1, topk_group=1,
                             topk_method="noaux_tc", scoring_func="sigmoid")
    params, _ = random_params(v3, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0,
                               progress=False, max_model_len=64, block=(128, 128))
    for layer in params.layers:
        mlp = (layer.mlp.w13, layer.mlp.w2) if isinstance(layer.mlp, MoEParams) else (layer.mlp.gate_up, layer.mlp.down)
        a = layer.attn
        for w in (a.qkv_a_proj, a.q_b_proj, a.w_uk, a.w_uv, a.o_proj, *mlp):
            assert isinstance(w, BlockFP8Weight)
            assert w.values.element_size() == 1
            assert w.scale_inv.numel() * 4 < 0.01 * w.values.numel()
        # kv_b_proj's heads of 128 + 128 rows fill their 128 x 128 blocks: each keeps its scales as stored.
        rows = v3.num_attention_heads * (v3.qk_nope_head_dim + v3.v_head_dim)
        assert a.w_uk.nbytes + a.w_uv.nbytes == rows * v3.kv_lora_rank + (rows // 128) * (v3.kv_lora_rank // 128) * 4
    fp8_leaves = [t for t in tree_leaves(params) if t.dtype == torch.float8_e4m3fn]
    values = sum(t.numel() for t in fp8_leaves)
    assert values > 0.9 * sum(t.numel() for t in tree_leaves(params) if t.ndim >= 2 and t.shape[0] > 256)
    estimate = params_bytes(v3, torch.bfloat16, max_model_len=64, block=(128, 128))
    assert sum(t.numel() * t.element_size() for t in tree_leaves(params)) == estimate
