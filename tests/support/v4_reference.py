"""Small random DeepSeek-V4 models from transformers (the oracle), and plans that address every cache group.

Test configs cross the window (8), several CSA blocks (rate 4) and HCA blocks
(rate 16) within a few dozen tokens, keep index_topk (3) below the number of
compressed entries, and give the indexer 16 heads so its ReLU scores do not tie.
Every weight is drawn afresh (sinks, position biases, hyper-connection scales and
bases included), so no path hides behind an initial value of zero or one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

import mla_func as mf

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]
CONFIG = dict(
    vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
    layer_types=LAYER_TYPES, mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=8, index_topk=3,
    partial_rotary_factor=0.5, hc_mult=3, hc_sinkhorn_iters=5, swiglu_limit=1.5, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    max_position_embeddings=256, eos_token_id=1,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, experts, tensor.shape, generator=generator))
            elif name.endswith("position_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif tensor.ndim >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * tensor.shape[-1] ** -0.5)
            elif name.endswith(("sinks", "bias", "base")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
            else:  # norm weights and mHC scales
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))


def make_reference(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> DeepseekV4ForCausalLM:
    config = DeepseekV4Config(**{**CONFIG, **overrides}, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    _randomize(model, seed)
    return model.to(dtype)


def save_reference(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> DeepseekV4ForCausalLM:
    model = make_reference(dtype, seed, **overrides)
    model.save_pretrained(folder)
    return model


def saved_model(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0,
                **overrides) -> tuple[mf.Model, DeepseekV4ForCausalLM]:
    """(the checkpoint loaded by mla-func on the CPU, transformers' model) of a reference saved in `folder`."""
    reference = save_reference(folder, dtype, seed, **overrides)
    return mf.load_model(folder, device="cpu", dtype=dtype), reference


def reference_logits(model: DeepseekV4ForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """transformers' full forward (no cache) over the tokens: [T, V]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids]), use_cache=False).logits[0]


@dataclass
class Seq:
    """One sequence's blocks in every cache group (distinct per `index`)."""

    index: int
    groups: tuple[mf.CacheGroup, ...]
    max_tokens: int = 64

    def tables(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for g in self.groups:
            n = g.blocks_for(self.max_tokens) + 1
            out.append(tuple(range(1 + self.index * n, 1 + (self.index + 1) * n)))
        return tuple(out)

    def plan(self, tokens: list[int], start: int, num_logits: int | None = None) -> mf.SeqPlan:
        tables = self.tables()
        return mf.SeqPlan(tuple(tokens), start, tables[0], len(tokens) if num_logits is None else num_logits,
                          group_block_tables=tables[1:])


def new_state(model: mf.Model, *, num_seqs: int = 4, block_size: int = 4, max_tokens: int = 64,
              kv_cache_dtype: str = "auto"):
    """A state with room in every cache group for `num_seqs` sequences' `Seq` tables of `max_tokens` tokens."""
    per_seq = -(-max_tokens // block_size) + 1
    num_blocks = 1 + num_seqs * per_seq
    while True:
        state = mf.init_state(model, num_blocks=num_blocks, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        # Each compressed group's block count follows num_blocks by its own rule: grow until Seq's fit.
        if all(g.num_blocks >= 1 + num_seqs * (g.blocks_for(max_tokens) + 1) for g in state.groups):
            return state
        num_blocks += per_seq


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())
