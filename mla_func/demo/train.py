"""Train the demo model end to end: tokenizer, weights, export, held-out perplexity.

    python -m mla_func.demo.train            # writes mla_func/demo/model/
    python -m mla_func.demo.train --out DIR  # somewhere else

The model is trained by mla-func's own pure forward: the loss is a function of
the params pytree's leaves (flattened with `mla_func.pytree.tree_flatten`), and
`torch.func.grad_and_value` differentiates it. Each step packs `batch_size`
windows of `seq_len + 1` tokens as one prefill `StepPlan` on a fresh cache, with
every fed token producing logits. The optimizer is AdamW written over the
leaves, with linear warm-up, cosine decay and global-norm gradient clipping.

Routing follows DeepSeek-V3's auxiliary-loss-free balancing: the router's
`e_score_correction_bias` is not trained by gradient (it only steers the top-k
choice); after each step it moves by `bias_update_rate` towards experts that
received fewer tokens than the mean.

Everything random comes from generators seeded by `--seed`, so a run with the
same seed, thread count, torch build and Python standard library gives the same
model. Training runs the reference ("torch") kernels, which are the
differentiable ones, on one CPU thread by default: on a CPU shared with other
processes, two threads ran several times slower than one (their parallel
sections wait on each other whenever either is descheduled).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import Model, load_model
from ..config import ModelConfig
from ..engine import Engine
from ..kernels import ops_for, record_expert_choice
from ..params import MoEParams, Params, hf_tensor_shapes, params_from_hf
from ..pytree import tree_flatten, tree_unflatten
from ..sampling import SamplingParams
from . import MODEL_DIR, data
from .export import save_checkpoint
from .lm import perplexity, windows_loss

SAMPLE_PROMPTS = ("Return the number of", "Create a new", "This module provides", "If the")


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a run; recorded in the model folder's training.json."""

    seed: int = 0
    vocab_size: int = 4096
    seq_len: int = 128          # tokens fed per window (each window holds seq_len + 1)
    batch_size: int = 4         # windows per step
    block_size: int = 64        # cache block size of the training steps
    steps: int = 2400
    lr: float = 2e-3
    min_lr_ratio: float = 0.1   # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1   # on matrices only, not on norm weights
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_norm: float = 1.0
    bias_update_rate: float = 1e-3
    threads: int = 1
    model: dict = field(default_factory=dict)  # overrides of demo_model_config's fields


def demo_model_config(vocab_size: int, **overrides) -> ModelConfig:
    """The demo architecture: DeepSeek-V3 in miniature.

    MLA with a low-rank query (q_lora_rank) and a 64-dim latent cache; one dense
    layer, then MoE layers of 8 routed experts (top-2, sigmoid scores, noaux_tc
    group-limited routing over 4 groups of 2, normalised weights) plus one shared
    expert. Token ids 0 and 1 are <|bos|> and <|eos|>. Embeddings are tied, which
    halves the largest matrix of so small a model.
    """
    fields = dict(
        model_type="deepseek_v3",
        vocab_size=vocab_size,
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=512,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=96,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_ids=(1,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def init_params(config: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Params:
    """Fresh float32 weights on `device` (drawn on the CPU, so every device gets the same), built through `params_from_hf` from names of `hf_tensor_shapes`.

    GPT-2's scheme: matrices ~ N(0, 0.02), with the projections that write into
    the residual stream (o_proj, down_proj) scaled by 1 / sqrt(2 * layers) so the
    stream's variance does not grow with depth; norm weights 1, correction bias 0.
    """
    shapes = hf_tensor_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * config.num_hidden_layers)

    def fetch(name: str) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    return params_from_hf(config, fetch, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------
# The params pytree as trainable leaves

class LeafLayout:
    """Splits the params pytree's leaves into trainable ones, correction biases and constants.

    Tied embeddings make `embed` and `lm_head` one tensor at two leaf positions:
    it is trained once (its gradient is the sum of both uses, which
    differentiation through the shared input gives for free).
    """

    def __init__(self, params: Params) -> None:
        leaves, self.spec = tree_flatten(params)
        constant_ids = {id(params.rope_cos), id(params.rope_sin)}
        bias_ids = [
            id(layer.mlp.e_score_correction_bias)
            for layer in params.layers
            if isinstance(layer.mlp, MoEParams) and layer.mlp.e_score_correction_bias is not None
        ]
        self.trainable: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = [None] * len(bias_ids)   # MoE layer order
        self.constants: dict[int, torch.Tensor] = {}
        # slot per leaf position: ("t", k) trainable k, ("b", k) bias k, ("c", position) constant
        self.slots: list[tuple[str, int]] = []
        seen: dict[int, int] = {}
        for pos, leaf in enumerate(leaves):
            if id(leaf) in bias_ids:
                k = bias_ids.index(id(leaf))
                self.biases[k] = leaf
                self.slots.append(("b", k))
            elif id(leaf) in constant_ids or not leaf.is_floating_point():
                self.constants[pos] = leaf
                self.slots.append(("c", pos))
            else:
                if id(leaf) not in seen:
                    seen[id(leaf)] = len(self.trainable)
                    self.trainable.append(leaf)
                self.slots.append(("t", seen[id(leaf)]))

    def params(self, trainable: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> Params:
        """The params pytree with these trainable leaves and correction biases."""
        leaves = []
        for kind, k in self.slots:
            leaves.append(trainable[k] if kind == "t" else biases[k] if kind == "b" else self.constants[k])
        return tree_unflatten(self.spec, leaves)


# ---------------------------------------------------------------------------------------------
# AdamW, schedule, clipping: plain functions over lists of tensors

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def clip_by_global_norm(grads: Sequence[torch.Tensor], max_norm: float) -> tuple[list[torch.Tensor], float]:
    """Scale all gradients by min(1, max_norm / ||g||) with ||g|| over every tensor; returns (grads, ||g||)."""
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    scale = min(1.0, max_norm / (norm + 1e-6))
    return [g * scale for g in grads], norm


def adamw(
    leaves: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    moments: tuple[list[torch.Tensor], list[torch.Tensor]],
    step: int,
    lr: float,
    cfg: TrainConfig,
) -> tuple[list[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """One AdamW update (decoupled weight decay on tensors of rank >= 2); returns new leaves and moments."""
    beta1, beta2 = cfg.betas
    first, second = moments
    correction1, correction2 = 1 - beta1 ** (step + 1), 1 - beta2 ** (step + 1)
    new_leaves, new_first, new_second = [], [], []
    for p, g, m, v in zip(leaves, grads, first, second):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / correction1) / ((v / correction2).sqrt() + cfg.eps)
        decay = cfg.weight_decay if p.dim() >= 2 else 0.0
        new_leaves.append(p * (1 - lr * decay) - lr * update)
        new_first.append(m)
        new_second.append(v)
    return new_leaves, (new_first, new_second)


# ---------------------------------------------------------------------------------------------
# Training

def train(params: Params, windows: Sequence[Sequence[int]], cfg: TrainConfig, *, progress: bool = True) -> tuple[Params, dict]:
    """Run cfg.steps AdamW steps over batches of `windows`; returns the trained params and a log.

    The log holds the per-step loss, the final expert loads and the wall time.
    """
    from tqdm.auto import tqdm

    layout = LeafLayout(params)
    trainable, biases = list(layout.trainable), list(layout.biases)
    num_experts = params.config.n_routed_experts

    def loss_fn(trainable, biases, windows):
        # DeepSeek-V3's bias update needs each step's per-expert load, which the
        # forward reports through an instrumented op table.
        ops, chosen = record_expert_choice(ops_for("torch"))
        loss = windows_loss(layout.params(trainable, biases), windows, block_size=cfg.block_size, ops=ops)
        # [moe layers, E] tokens per expert: returned as an auxiliary output so it leaves the transform
        loads = torch.stack([F.one_hot(ids.clamp(min=0), num_experts).sum(dim=(0, 1)) for ids in chosen])
        return loss, loads

    grad_fn = torch.func.grad_and_value(loss_fn, has_aux=True)
    moments = ([torch.zeros_like(p) for p in trainable], [torch.zeros_like(p) for p in trainable])
    batches = data.iter_batches(windows, cfg.batch_size, seed=cfg.seed)
    losses: list[float] = []
    smooth = None
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="training", unit="step", disable=not progress, dynamic_ncols=True)
    for step in bar:
        grads, (loss, loads) = grad_fn(trainable, biases, next(batches))
        grads, grad_norm = clip_by_global_norm(grads, cfg.clip_norm)
        lr = lr_at(step, cfg)
        trainable, moments = adamw(trainable, grads, moments, step, lr, cfg)
        # Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded.
        loads = loads.float()
        biases = [
            b + cfg.bias_update_rate * torch.sign(load.mean() - load) for b, load in zip(biases, loads)
        ]
        losses.append(float(loss))
        smooth = losses[-1] if smooth is None else 0.98 * smooth + 0.02 * losses[-1]
        bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{lr:.2e}", gnorm=f"{grad_norm:.2f}")
    bar.close()
    elapsed = time.perf_counter() - start
    loads = (loads / loads.sum(dim=-1, keepdim=True)).tolist()
    log = {"losses": losses, "train_seconds": elapsed, "final_expert_load_fractions": loads}
    return layout.params(trainable, biases), log


def eval_subset_documents() -> list[data.Document]:
    """The held-out documents of `data.EVAL_SUBSET_FILES`: the quick check the tests repeat."""
    root = data.stdlib_root()
    files = [root / f for f in data.EVAL_SUBSET_FILES if (root / f).is_file()]
    return [d for d in data.stdlib_documents(files, root) if d.heldout]


def samples(model: Model, prompts: Sequence[str], *, max_new_tokens: int, temperature: float, seed: int) -> list[dict]:
    """Continuations of `prompts` (strings) through the engine: [{prompt, temperature, ids, text}].

    Each prompt has its own seed, so its sample does not depend on the others; the
    engine stops at the config's eos token.
    """
    engine = Engine(model, graphs=False, max_num_seqs=len(prompts))
    params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed + i) for i in range(len(prompts))]
    completions = engine.generate(list(prompts), params)
    return [{"prompt": prompt, "temperature": temperature, "ids": list(c.raise_for_error().token_ids),
             "text": prompt + model.tokenizer.decode(list(c.token_ids), skip_special_tokens=True)}
            for prompt, c in zip(prompts, completions)]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="model folder to write (default: the shipped one)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--threads", type=int, default=TrainConfig.threads,
                        help="torch CPU threads (default 1: on a CPU shared with other processes one thread "
                             "ran several times faster than two)")
    parser.add_argument("--model", type=json.loads, default={}, help="JSON overrides of the model config fields")
    parser.add_argument("--device", default="cpu", help="where to train (the shipped model is trained on cpu)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = TrainConfig(seed=args.seed, steps=args.steps, lr=args.lr, threads=args.threads, model=args.model)
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    say(f"reading docstrings under {data.stdlib_root()}")
    docs = data.stdlib_documents()
    train_docs, heldout_docs = data.split_documents(docs)
    say(f"{len(docs)} documents: {len(train_docs)} for training, {len(heldout_docs)} held out")
    tokenizer = data.train_tokenizer((d.text for d in train_docs), cfg.vocab_size)
    train_windows = data.pack(data.encode_documents(tokenizer, train_docs), cfg.seq_len)
    heldout_windows = data.pack(data.encode_documents(tokenizer, heldout_docs), cfg.seq_len)
    say(f"tokenizer trained ({tokenizer.get_vocab_size()} tokens); {len(train_windows)} training windows "
        f"of {cfg.seq_len} tokens, {len(heldout_windows)} held out")

    config = demo_model_config(tokenizer.get_vocab_size(), **cfg.model)
    params = init_params(config, cfg.seed, args.device)
    num_params = sum(t.numel() for t in {id(t): t for t in tree_flatten(params)[0]}.values()
                     if t is not params.rope_cos and t is not params.rope_sin)
    say(f"model: {num_params / 1e6:.2f}M parameters; training {cfg.steps} steps of "
        f"{cfg.batch_size} x {cfg.seq_len} tokens on {cfg.threads} thread(s)")
    params, log = train(params, train_windows, cfg, progress=not args.no_progress)
    fp32_ppl, _ = perplexity(params, heldout_windows, block_size=cfg.block_size)
    say(f"trained in {log['train_seconds']:.0f}s; held-out perplexity {fp32_ppl:.2f} (float32 weights before export)")

    bos, eos = tokenizer.token_to_id(data.BOS), tokenizer.token_to_id(data.EOS)
    save_checkpoint(args.out, params, tokenizer=tokenizer, extra_config={"bos_token_id": bos, "eos_token_id": eos})
    # Every number below comes from the exported (bfloat16-stored) files, loaded back in float32.
    model = load_model(args.out, dtype=torch.float32, device="cpu")
    heldout_ppl, heldout_tokens = perplexity(model.params, heldout_windows, block_size=cfg.block_size)
    subset_docs = eval_subset_documents()
    subset_windows = data.pack(data.encode_documents(tokenizer, subset_docs), cfg.seq_len)
    subset_ppl, subset_tokens = perplexity(model.params, subset_windows, block_size=cfg.block_size)
    greedy = samples(model, SAMPLE_PROMPTS, max_new_tokens=24, temperature=0.0, seed=cfg.seed)
    sampled = samples(model, SAMPLE_PROMPTS, max_new_tokens=40, temperature=0.8, seed=cfg.seed)
    tail = log["losses"][-100:]
    metrics = {
        "command": " ".join(["python -m mla_func.demo.train", *(sys.argv[1:] if argv is None else argv)]),
        "train_config": asdict(cfg),
        "model_parameters": num_params,
        "documents": {"train": len(train_docs), "heldout": len(heldout_docs)},
        "train_tokens_available": len(train_windows) * cfg.seq_len,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_seconds": round(log["train_seconds"], 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "final_train_loss_mean_last_100_steps": sum(tail) / len(tail),
        "heldout_perplexity": heldout_ppl,
        "heldout_perplexity_fp32_before_export": fp32_ppl,
        "heldout_tokens": heldout_tokens,
        "eval_subset": {"files": list(data.EVAL_SUBSET_FILES), "documents": len(subset_docs),
                        "tokens": subset_tokens, "perplexity": subset_ppl, "text_sha256": data.text_digest(subset_docs)},
        "final_expert_load_fractions": log["final_expert_load_fractions"],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "samples_greedy": greedy,
        "samples_temperature_0.8": sampled,
        "loss_curve_every_50_steps": [round(x, 4) for x in log["losses"][::50]],
    }
    (args.out / "training.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (args.out / "TRAINING.md").write_text(_training_md(metrics, config))
    say(f"wrote {args.out}")
    print(f"held-out perplexity: {heldout_ppl:.2f} over {heldout_tokens} tokens "
          f"(uniform would be {config.vocab_size})")
    for s in greedy + sampled:
        print(f"  [T={s['temperature']}] {s['text']!r}")
    return metrics


def _training_md(m: dict, config: ModelConfig) -> str:
    c = m["train_config"]
    lines = [
        "# The demo model",
        "",
        "A DeepSeek-V3-architecture model (MLA with a low-rank query, MoE with a shared",
        "expert, sigmoid noaux_tc routing) trained by mla-func's own pure forward under",
        "`torch.func.grad_and_value`, on the docstrings of Python's standard library.",
        "",
        "Reproduce (about the time below on a 2-core CPU shared with other work):",
        "",
        f"    {m['command']}",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {m['model_parameters'] / 1e6:.2f}M (tied embeddings; weights stored in bfloat16) |",
        f"| layers / hidden / heads | {config.num_hidden_layers} / {config.hidden_size} / {config.num_attention_heads} |",
        f"| MLA | q_lora_rank {config.q_lora_rank}, kv_lora_rank {config.kv_lora_rank}, "
        f"qk {config.qk_nope_head_dim}+{config.qk_rope_head_dim}, v {config.v_head_dim} |",
        f"| MoE | {config.n_routed_experts} experts top-{config.num_experts_per_tok} "
        f"(+{config.n_shared_experts} shared), {config.n_group} groups top-{config.topk_group}, "
        f"first {config.first_k_dense_replace} layer dense |",
        f"| tokenizer | byte-level BPE, {config.vocab_size} tokens, <\\|bos\\|> = 0, <\\|eos\\|> = 1 |",
        f"| documents | {m['documents']['train']} training, {m['documents']['heldout']} held out "
        "(sha256 of `path:qualname` mod 20 == 0) |",
        f"| steps | {c['steps']} x {c['batch_size']} windows of {c['seq_len']} tokens "
        f"(AdamW lr {c['lr']}, warm-up {c['warmup_steps']}, cosine to {c['min_lr_ratio']}x, "
        f"wd {c['weight_decay']}, clip {c['clip_norm']}) |",
        f"| tokens seen | {m['tokens_seen']} ({m['tokens_seen'] / m['train_tokens_available']:.2f} epochs) |",
        f"| time | {m['train_seconds']:.0f}s training, {m['total_seconds']:.0f}s in all, "
        f"{c['threads']} thread(s), Python {m['python']}, torch {m['torch']} |",
        f"| final train loss | {m['final_train_loss_mean_last_100_steps']:.3f} nats (mean of the last 100 steps) |",
        f"| **held-out perplexity** | **{m['heldout_perplexity']:.2f}** over {m['heldout_tokens']} tokens "
        f"(the exported weights, loaded in float32; {m['heldout_perplexity_fp32_before_export']:.2f} "
        "before the bfloat16 export) |",
        f"| test subset perplexity | {m['eval_subset']['perplexity']:.3f} over {m['eval_subset']['tokens']} tokens "
        "(held-out documents of the files in `data.EVAL_SUBSET_FILES`) |",
        "",
        "Perplexity is exp(mean next-token NLL) over the held-out documents packed like",
        "the training data (each as `<|bos|> text <|eos|>`, concatenated, cut into",
        f"windows of {c['seq_len']} + 1 tokens).",
        "",
        "## Samples",
        "",
    ]
    for s in m["samples_greedy"] + m["samples_temperature_0.8"]:
        lines.append(f"- T={s['temperature']}: `{s['text']!r}`")
    lines += ["", "All numbers are in `training.json`, written by the same run.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.exit(0)
