"""The shipped demo model's MTP layer: it loads as DeepSeek-V3 lays it out, its drafts leave greedy tokens
unchanged (mixed steps, chunked prefill, prefix caching, preemption), and it drafts well on held-out text."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import DeepseekV3ForCausalLM

import mla_func as mf
from mla_func.demo import MODEL_DIR, data
from mla_func.demo.evaluate import eval_subset_documents
from mla_func.demo.lm import windows_step
from mla_func.demo.mtp_lm import mtp_logits, windows_losses
from mla_func.demo.speculation import heldout_prompts, measure_acceptance
from mla_func.models.mtp.params import mtp_tensor_shapes
from mla_func.models.tensor_shapes import hf_tensor_shapes
from support.mtp_checkpoints import StepRecorder, check_drafted_run
from support.mla_reference import rel_err
from support.mtp_checkpoints import mtp_reference

# Measured on the shipped model (python -m mla_func.demo.speculation: 64 held-out prompts, 32 greedy
# tokens each; TRAINING.md): acceptance 0.79 / 0.70 / 0.61 for k = 1 / 2 / 3. The floors are three
# quarters of those, rounded down: room for the test's smaller prompt set (16 prompts from the
# eval-subset files, 24 tokens each, which measured 0.76 / 0.66 / 0.54) and for float rounding
# elsewhere flipping near-tied argmaxes, while a drafter that learned nothing would accept almost none.
ACCEPTANCE_FLOORS = {1: 0.59, 2: 0.52, 3: 0.45}


@pytest.fixture(scope="module")
def demo():
    return mf.load_model("demo", mtp=True, dtype=torch.float32, device="cpu")


def test_the_shipped_checkpoint_is_deepseek_v3s_layout_with_one_mtp_layer(demo):
    raw = json.loads((MODEL_DIR / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # Exactly the model's tensors and the MTP layer's required ones: the tied embedding and head
    # are not copied (load_model(mtp=True) uses the model's own).
    assert names == set(hf_tensor_shapes(demo.config)) | set(mtp_tensor_shapes(demo.config))
    assert all(n.startswith(f"model.layers.{demo.config.num_hidden_layers}.") for n in mtp_tensor_shapes(demo.config))
    assert demo.mtp is not None
    assert demo.mtp.embed is demo.params.embed and demo.mtp.head is demo.params.lm_head
    # Loaded without mtp the checkpoint is the same model, and has no drafter.
    plain = mf.load_model("demo", dtype=torch.float32, device="cpu")
    assert plain.mtp is None and torch.equal(plain.params.embed, demo.params.embed)
    with pytest.raises(ValueError, match=r"load_model\(\.\.\., mtp=True\)"):
        mf.Engine(plain, speculative_tokens=1)


def test_the_training_loss_is_the_papers_mtp_loss(demo):
    """The MTP loss the trainer minimises, on the shipped weights, against DeepSeek-V3's equations
    (`support.mtp_checkpoints.mtp_reference`: transformers' decoder layer, the rest written from the paper)."""
    windows = data.pack(data.encode_documents(demo.tokenizer, eval_subset_documents()), 24)[:3]
    hf = DeepseekV3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float64, attn_implementation="eager",
                                               experts_implementation="eager").eval()
    tensors = load_file(MODEL_DIR / "model.safetensors")
    want = torch.cat([mtp_reference(hf, tensors, list(w[:-1]))[1] for w in windows])      # [3 * 23, V]
    targets = torch.tensor([t for w in windows for t in w[2:]])
    state, batch, mode, _ = windows_step(demo.config, windows, block_size=16)
    out, _ = mf.forward_outputs(demo.params, state, batch, mode)
    got, got_targets = mtp_logits(demo.params, demo.mtp, windows, out.hidden[: mode.num_logits], block_size=16,
                                  copy=False)
    assert torch.equal(got_targets, targets)
    assert got.shape == want.shape and rel_err(got, want) < 1e-4
    main, mtp = windows_losses(demo.params, demo.mtp, windows, block_size=16)
    assert mtp is not None and float(mtp) == pytest.approx(float(F.cross_entropy(want, targets)), rel=1e-5)
    # A trained MTP layer: its perplexity several times below a uniform guess's, and near the model's own.
    assert float(mtp) < math.log(demo.config.vocab_size) - 2 and float(mtp) < float(main) + 1, (mtp, main)


def _engine(model: mf.Model, k: int, **kwargs: object) -> mf.Engine:
    settings: dict[str, object] = dict(block_size=4, num_blocks=60, max_num_seqs=5, max_num_batched_tokens=24,
                                       long_prefill_token_threshold=5, graphs=False, speculative_tokens=k)
    return mf.Engine(model, **{**settings, **kwargs})


def _requests(model: mf.Model, seed: int) -> tuple[list[list[int]], list[mf.SamplingParams]]:
    """12 prompts cut from held-out documents, a third of them behind a shared 14-token prefix (three full
    blocks of 4: prefix-cache hits); greedy, half stopping at "." or <|eos|>, half running past <|eos|>,
    some penalised."""
    rng = random.Random(seed)
    docs = heldout_prompts(model.tokenizer, eval_subset_documents(), count=20, prompt_tokens=16)
    shared = model.tokenizer.encode("Return a new list containing the items of the iterable, in the").ids
    period = model.tokenizer.token_to_id(".")
    prompts, params = [], []
    for i in range(12):
        doc = docs[rng.randrange(len(docs))]
        prompt = doc[: rng.randrange(2, 17)]
        prompts.append(shared + prompt[1:] if i % 3 == 0 else prompt)
        # "." (a stop token here) ends most docstring sentences: stops land inside accepted drafts.
        extra: dict[str, object] = dict(ignore_eos=True) if i % 2 else dict(stop_token_ids=(period,), min_tokens=2)
        if i % 5 == 2:
            extra["repetition_penalty"] = 1.3
        params.append(mf.SamplingParams(temperature=0, max_tokens=rng.randrange(4, 20), **extra))
    return prompts, params


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_with_drafts_equal_decoding_without(demo, k):
    prompts, params = _requests(demo, k)
    want = _engine(demo, 0).generate(prompts, params)
    engine = _engine(demo, k, num_blocks=18)   # tight: preemption by recompute
    seen = StepRecorder(engine)
    got = engine.generate(prompts, params)
    check_drafted_run(engine, seen, got, want, k)
    assert any(c.finish_reason == "stop" for c in got) and any(c.finish_reason == "length" for c in got)


def test_prefix_cache_hits_keep_the_tokens(demo):
    prompts, params = _requests(demo, 9)
    engine = _engine(demo, 2, num_blocks=200)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)     # every full prompt block is a hit now
    assert engine.scheduler.allocator.num_cached_blocks > 0
    want = _engine(demo, 0, enable_prefix_caching=False).generate(prompts, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again] == [c.token_ids for c in want]


def test_acceptance_on_heldout_prompts_is_above_the_floor(demo):
    prompts = heldout_prompts(demo.tokenizer, eval_subset_documents(), count=16)
    runs = measure_acceptance(demo, prompts, ks=(1, 2, 3), max_tokens=24)   # raises if any token differs
    for run in runs:
        assert run.generated == 16 * 24 and run.drafted > 0
        assert run.rate > ACCEPTANCE_FLOORS[run.k], (run.k, run.accepted, run.drafted)
    # The training run recorded the same measurement over all its held-out prompts.
    recorded = json.loads((MODEL_DIR / "training.json").read_text())["acceptance"]["runs"]
    assert [r["k"] for r in recorded] == [1, 2, 3]
    assert all(r["accepted"] > 0 and r["rate"] > ACCEPTANCE_FLOORS[r["k"]] for r in recorded)


def test_generate_on_the_demo_model_drafts_with_its_mtp_layer():
    from support.cli_process import mla_func

    common = ("generate", "Return the number of", "--max-tokens", "16", "--temperature", "0", "--ignore-eos")
    plain = mla_func(*common)
    drafted = mla_func(*common, "--speculative-tokens", "2")
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert drafted.stdout == plain.stdout
    rate = re.search(r"acceptance rate (\d+)% \((\d+) of (\d+) drafts\)", drafted.stderr)
    assert rate is not None and 0 < int(rate.group(2)) <= int(rate.group(3)), drafted.stderr
