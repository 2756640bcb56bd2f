"""The demo model that ships with the package: loading, transformers parity, golden generation, perplexity."""

from __future__ import annotations

import json
import re

import pytest
import torch

import mla_func as mf
from mla_func.core.params import params_from_hf
from mla_func.demo import MODEL_DIR, data
from mla_func.demo.evaluate import eval_subset_documents
from mla_func.demo.export import params_to_hf
from mla_func.demo.lm import perplexity
from mla_func.demo.train import TrainConfig
from mla_func.models.presets import preset_names
from mla_func.models.tensor_shapes import hf_tensor_shapes
from mla_func.pytree import tree_leaves

PROMPT = "Return the number of"
# The greedy continuation of PROMPT by the shipped weights (12 steps: " the given
# string.\n\nThe default value is a list"), recorded once after training; retraining changes it.
GOLDEN_IDS = [266, 626, 450, 15, 200, 200, 471, 606, 462, 295, 260, 491]
PARITY_TEXT = (
    "Return a new list containing all items from the iterable in ascending order.\n\n"
    "A custom key function can be supplied to customize the sort order."
)


@pytest.fixture(scope="module")
def demo():
    return mf.load_model("demo", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def metrics():
    return json.loads((MODEL_DIR / "training.json").read_text())


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|"""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def test_demo_preset_is_a_small_deepseek_v3(demo):
    c = demo.config
    assert c.model_type == "deepseek_v3"
    assert c.q_lora_rank is not None and c.n_routed_experts and c.n_shared_experts
    assert (c.scoring_func, c.topk_method) == ("sigmoid", "noaux_tc")
    assert demo.tokenizer is not None and demo.tokenizer.get_vocab_size() == c.vocab_size
    raw = json.loads((MODEL_DIR / "config.json").read_text())
    assert demo.tokenizer.token_to_id(data.BOS) == raw["bos_token_id"]
    assert demo.tokenizer.token_to_id(data.EOS) == raw["eos_token_id"]
    # encode() starts text the way every training document starts
    assert demo.tokenizer.encode(PROMPT).ids[0] == raw["bos_token_id"]
    assert "demo" in preset_names()


def test_transformers_gives_the_same_logits(demo):
    transformers = pytest.importorskip("transformers")
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(
        MODEL_DIR, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
    ).eval()
    tokens = demo.tokenizer.encode(PARITY_TEXT).ids
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0]
    state = mf.init_state(demo.config, num_blocks=8, block_size=16)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(tokens), 0, tuple(range(1, 8)), len(tokens)),))
    batch, mode = mf.plan_step(demo.config, state, plan)
    got, _ = mf.forward(demo.params, state, batch, mode)
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-4
    # transformers' own greedy decoding continues the golden prompt the same way
    prompt = demo.tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=len(GOLDEN_IDS), do_sample=False, eos_token_id=None)
    assert out[0, len(prompt):].tolist() == GOLDEN_IDS


def greedy(model: mf.Model, prompt_ids: list[int], steps: int, block_size: int = 16) -> list[int]:
    """Prefill the prompt, then decode `steps - 1` more tokens, each the argmax of the last logits."""
    table = tuple(range(1, 1 + -(-(len(prompt_ids) + steps) // block_size)))
    state = mf.init_state(model.config, num_blocks=1 + len(table), block_size=block_size)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(tuple(prompt_ids), 0, table, 1),))
    out, pos = [], len(prompt_ids)
    for _ in range(steps):
        batch, mode = mf.plan_step(model.config, state, plan)
        logits, state = mf.forward(model.params, state, batch, mode)
        out.append(int(logits[0].argmax()))
        plan = mf.StepPlan(decode=(mf.SeqPlan((out[-1],), pos, table, 1),))
        pos += 1
    return out


def test_greedy_continuation_is_golden_and_reads_as_words(demo, metrics):
    ids = demo.tokenizer.encode(PROMPT).ids
    new = greedy(demo, ids, 12)
    assert new == GOLDEN_IDS
    # The training run's own greedy sample (which stops at <|eos|>) agrees as far as it goes.
    recorded = next(s for s in metrics["samples_greedy"] if s["prompt"] == PROMPT)["ids"]
    common = min(len(recorded), len(new))
    assert common > 0 and new[:common] == recorded[:common]
    text = demo.tokenizer.decode(new)
    printable = sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text)
    assert printable >= 0.95 * len(text), text
    words = re.findall(r"[A-Za-z]{2,}", text)
    assert len(words) >= 4, text
    assert sum(len(w) for w in words) >= 0.6 * len(text.replace(" ", "").replace("\n", "")), text


def test_heldout_perplexity_is_reproduced(demo, metrics):
    cfg = TrainConfig(**{**metrics["train_config"], "betas": tuple(metrics["train_config"]["betas"])})
    docs = eval_subset_documents()
    windows = data.pack(data.encode_documents(demo.tokenizer, docs), cfg.seq_len)
    ppl, count = perplexity(demo.params, windows, block_size=cfg.block_size)
    # Far below a uniform guess over the vocabulary, whatever Python's docstrings are here.
    assert ppl < demo.config.vocab_size / 40
    recorded = metrics["eval_subset"]
    if recorded["text_sha256"] != data.text_digest(docs):
        pytest.skip("this Python's standard library has other docstrings than the training run's: "
                    f"perplexity {ppl:.2f} here, {recorded['perplexity']:.2f} recorded")
    assert count == recorded["tokens"]
    assert ppl == pytest.approx(recorded["perplexity"], rel=1e-4)
    # And the recorded full held-out perplexity is of the same order as this subset's.
    assert metrics["heldout_perplexity"] == pytest.approx(ppl, rel=0.5)


def test_params_to_hf_inverts_params_from_hf():
    model = mf.load_model("tiny", dtype=torch.float32, device="cpu", seed=3)
    tensors = params_to_hf(model.params)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == hf_tensor_shapes(model.config)
    rebuilt = params_from_hf(model.config, tensors.__getitem__, dtype=torch.float32, device="cpu")
    for a, b in zip(tree_leaves(model.params), tree_leaves(rebuilt), strict=True):
        assert torch.equal(a, b)
