"""Small random DeepSeek-V3 checkpoints with a multi-token-prediction layer.

transformers builds and saves the model's own layers (`reference_models`) but not the
MTP layer, so its tensors are drawn here, independently, and added to the saved file
under `model.layers.{num_hidden_layers}.` as DeepSeek-V3's checkpoints name them.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

import mla_func as mf
from mla_func.models.mtp.params import mtp_tensor_shapes
from support.mla_reference import make_reference


def add_mtp_layer(path: Path, seed: int, *, with_copies: bool = False, echo: bool = False) -> None:
    """Append random MTP tensors to `path`/model.safetensors (with copies of the embedding and head).

    echo: make a drafter that guesses well on repetitive text: eh_proj passes the hidden state
    through and the layer's output projections are small, so the drafter's logits are close
    to the target's logits one position back (its guess for the next token is the target's
    guess for the current one).
    """
    config = mf.read_config(path / "config.json")
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(path / "model.safetensors")
    for name, shape in mtp_tensor_shapes(config).items():
        if len(shape) >= 2:
            value = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
        elif "bias" in name:
            value = torch.randn(shape, generator=generator) * 0.1
        else:  # norm weights
            value = 1.0 + 0.2 * torch.randn(shape, generator=generator)
        if echo and name.endswith("eh_proj.weight"):
            value = torch.cat([torch.zeros(shape[0], shape[0]), torch.eye(shape[0])], dim=1)
        elif echo and name.endswith(("o_proj.weight", "down_proj.weight")):
            value = value * 0.05
        tensors[name] = value.to(tensors["model.embed_tokens.weight"].dtype)
    if with_copies:
        prefix = f"model.layers.{config.num_hidden_layers}."
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def mtp_checkpoint(path: Path, *, variant: str = "v3-qlora-noaux", seed: int = 0, with_copies: bool = False,
                   echo: bool = False, **overrides: object) -> tuple[torch.nn.Module, Path]:
    """A transformers model saved at `path` with an MTP layer added; returns (the model, path)."""
    model = make_reference(variant, seed=seed, **overrides)
    model.save_pretrained(path)
    add_mtp_layer(path, seed + 1000, with_copies=with_copies, echo=echo)
    return model, path


def drafting_engine(model: mf.Model, k: int, **kwargs) -> mf.Engine:
    """An engine with k drafts a step (0: none) in small blocks, chunked prefill and mixed steps."""
    settings = dict(block_size=4, num_blocks=40, max_num_seqs=5, max_num_batched_tokens=24,
                    long_prefill_token_threshold=5, speculative_tokens=k)
    return mf.Engine(model, **{**settings, **kwargs})


def drafting_requests(seed: int, vocab: int) -> tuple[list[list[int]], list[mf.SamplingParams]]:
    """12 greedy requests over a vocabulary of `vocab` (at least 7) tokens: some share a prefix of full
    blocks (prefix-cache hits), some stop at token 6, some penalise repetition."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(9)]
    prompts, params = [], []
    for i in range(12):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))]
        prompts.append(shared + prompt if i % 3 == 0 else prompt)   # shared full blocks: prefix-cache hits
        extra = dict(stop_token_ids=(6,), min_tokens=2) if i % 4 == 1 else dict(ignore_eos=True)
        if i % 5 == 2:
            extra["repetition_penalty"] = 1.3
        params.append(mf.SamplingParams(temperature=0, max_tokens=rng.randrange(2, 15), **extra))
    return prompts, params


class StepRecorder:
    """Records every step the engine's scheduler plans (wrapping `schedule`, which it calls once a step)."""

    def __init__(self, engine: mf.Engine):
        self.steps: list = []
        schedule = engine.scheduler.schedule

        def recorded():
            step = schedule()
            if step is not None:
                self.steps.append(step)
            return step

        engine.scheduler.schedule = recorded


def check_drafted_run(engine: mf.Engine, seen: StepRecorder, got: list, want: list, k: int) -> None:
    """A run with k drafts gave the tokens of the run without (`want`), through verify steps of k + 1
    tokens, mixed steps, chunks after a context and preemption, some drafts accepted and some not,
    and left no block behind."""
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
    stats = engine.speculative_stats
    assert 0 < stats.accepted < stats.drafted
    plans = [s.plan for s in seen.steps]
    assert any(p.decode_q_len == k + 1 for p in plans)
    assert any(p.prefill and p.decode for p in plans)                              # mixed steps
    assert any(s.start_pos > 0 for p in plans for s in p.prefill)                  # chunks after context
    assert any(s.preempted for s in seen.steps)                                    # recompute
    engine.scheduler.check_invariants()
    allocator = engine.scheduler.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks                # no block leaks
    assert allocator.num_cached_blocks > 0


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def mtp_reference(hf, tensors, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [n, D] the target's normed last hidden states, MTP logits [n - 1, V] of rows 0..n-2)."""
    config = hf.config
    layer_index = config.num_hidden_layers
    prefix = f"model.layers.{layer_index}."
    mtp_config = copy.deepcopy(config)
    mtp_config.num_hidden_layers = layer_index + 1
    block = DeepseekV3DecoderLayer(mtp_config, layer_index).double().eval()
    w = {k[len(prefix):]: v.double() for k, v in tensors.items() if k.startswith(prefix)}
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.", "mlp.experts.")
    layer = {k: v for k, v in w.items() if not k.startswith(own)}
    # transformers holds the routed experts stacked: gate_up [E, 2I, D] (gate rows first), down [E, D, I].
    experts = range(config.n_routed_experts)
    layer["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
    layer["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    block.load_state_dict(layer)
    eps = config.rms_norm_eps
    ids = torch.tensor([tokens])
    h = hf.model(ids).last_hidden_state[0]                                   # [n, D]
    emb = hf.model.embed_tokens(ids[0, 1:])                                  # Emb(t_{i+1}), [n - 1, D]
    x = torch.cat([rms(emb, w["enorm.weight"], eps), rms(h[:-1], w["hnorm.weight"], eps)], -1)
    x = x @ w["eh_proj.weight"].T                                            # [n - 1, D]
    n = x.shape[0]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    y = block(x[None], attention_mask=mask, position_ids=positions,
              position_embeddings=hf.model.rotary_emb(x[None], positions))[0]
    logits = rms(y, w["shared_head.norm.weight"], eps) @ hf.lm_head.weight.T
    return h, logits
