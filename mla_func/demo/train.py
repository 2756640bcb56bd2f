"""Train the demo model end to end: tokenizer, weights, export, held-out perplexity.

    python -m mla_func.demo.train            # writes mla_func/demo/model/
    python -m mla_func.demo.train --out DIR  # somewhere else

The model is trained by mla-func's own pure forward: the loss is a function of
the params pytree's leaves (flattened with `mla_func.pytree.tree_flatten`), and
`torch.func.grad_and_value` differentiates it. Each step packs `batch_size`
windows of `seq_len + 1` tokens as one prefill `StepPlan` on a fresh cache, with
every fed token producing logits. `torch.optim.AdamW` updates the trainable
leaves, with global-norm clipping (`torch.nn.utils.clip_grad_norm_`) and a linear
warm-up then cosine decay (`torch.optim.lr_scheduler`).

The model has one multi-token-prediction (MTP) layer, DeepSeek-V3's depth-1 module
(`mtp_lm`): the loss is the next-token cross entropy plus `mtp_weight` times the MTP
layer's next-next-token cross entropy. The weight is 0.3, then 0.1 from `mtp_late_fraction`
of the steps on, as DeepSeek-V3 lowered it from 0.3 to 0.1 after about 68% of its tokens.
The export writes the MTP layer where DeepSeek-V3's checkpoints hold it, so
`load_model(..., mtp=True)` serves it as the drafter of speculative decoding.

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

from mla_func.core.params import Params
from mla_func.demo import MODEL_DIR, data
from mla_func.demo.architecture import count_parameters, demo_model_config, init_mtp_params, init_params
from mla_func.demo.evaluate import evaluate
from mla_func.demo.export import save_checkpoint
from mla_func.demo.leaves import LeafLayout
from mla_func.demo.lm import perplexity
from mla_func.demo.mtp_lm import windows_losses
from mla_func.demo.report import training_md
from mla_func.kernels import ops_for, record_expert_choice
from mla_func.models.load import load_model
from mla_func.models.mtp.params import MTPParams

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
    mtp_layers: int = 1         # MTP depth: 1 (DeepSeek-V3's) or 0 (none)
    mtp_weight: float = 0.3     # lambda of the MTP loss ...
    mtp_weight_late: float = 0.1
    mtp_late_fraction: float = 0.68  # ... which is mtp_weight_late from this fraction of the steps on
    model: dict = field(default_factory=dict)  # overrides of demo_model_config's fields

    def __post_init__(self) -> None:
        if self.mtp_layers not in (0, 1):
            raise ValueError(f"TrainConfig.mtp_layers: expected 0 or 1 (one MTP layer, as DeepSeek-V3), "
                             f"got {self.mtp_layers!r}")

    def mtp_weight_at(self, step: int) -> float:
        """lambda at step `step` (0-based)."""
        return self.mtp_weight if step < round(self.mtp_late_fraction * self.steps) else self.mtp_weight_late


# ---------------------------------------------------------------------------------------------
# Optimizer and schedule: torch.optim over the trainable leaves

def make_optimizer(
    trainable: Sequence[torch.Tensor], cfg: TrainConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with decoupled weight decay on matrices only (not on norm weights), and the
    schedule: linear warm-up over warmup_steps to lr, then cosine down to lr * min_lr_ratio
    at the last step. The scheduler is stepped once per optimizer step."""
    matrices = [p for p in trainable if p.dim() >= 2]
    vectors = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
    )
    decay_steps = max(1, cfg.steps - 1 - cfg.warmup_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=cfg.lr * cfg.min_lr_ratio)
    if cfg.warmup_steps == 0:
        return optimizer, cosine
    warmup = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1 / cfg.warmup_steps, end_factor=1.0, total_iters=max(1, cfg.warmup_steps - 1)
    )
    return optimizer, torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[cfg.warmup_steps])


# ---------------------------------------------------------------------------------------------
# Training

def train(params: Params, windows: Sequence[Sequence[int]], cfg: TrainConfig, *, mtp: MTPParams | None = None,
          progress: bool = True) -> tuple[Params, MTPParams | None, dict]:
    """Run cfg.steps AdamW steps over batches of `windows`; returns the trained params, MTP layer
    (None without one) and a log.

    `params` and `mtp` are left as they are: training updates copies of their leaves. The log
    holds the per-step losses (next-token and MTP) and learning rate, the final expert loads
    and the wall time.
    """
    from tqdm.auto import tqdm

    layout = LeafLayout(params, mtp)
    trainable = [p.detach().clone() for p in layout.trainable]
    biases = list(layout.biases)
    num_experts = params.config.n_routed_experts
    if num_experts is None:
        raise ValueError("train: the demo trainer updates MoE correction biases; the config has no routed experts")

    def loss_fn(trainable: list[torch.Tensor], biases: list[torch.Tensor], windows: Sequence[Sequence[int]],
                weight: float) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        # DeepSeek-V3's bias update needs each step's per-expert load, which the
        # forward reports through an instrumented op table.
        ops, chosen = record_expert_choice(ops_for("torch"))
        p, m = layout.tree(trainable, biases)
        main, mtp_loss = windows_losses(p, m, windows, block_size=cfg.block_size, ops=ops)
        # [moe layers, E] tokens per expert (the model's layers, then the MTP layer's): returned as an
        # auxiliary output so it leaves the transform
        loads = torch.stack([F.one_hot(ids.clamp(min=0), num_experts).sum(dim=(0, 1)) for ids in chosen])
        if mtp_loss is None:
            return main, (main, torch.full((), math.nan), loads)
        return main + weight * mtp_loss, (main, mtp_loss, loads)

    # torch.func differentiates the pure loss; the optimizer then reads the
    # gradients from `.grad` and updates the leaves in place.
    grad_fn = torch.func.grad_and_value(loss_fn, has_aux=True)
    optimizer, schedule = make_optimizer(trainable, cfg)
    batches = data.iter_batches(windows, cfg.batch_size, seed=cfg.seed)
    losses: list[float] = []
    mtp_losses: list[float] = []
    lrs: list[float] = []
    smooth = None
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="training", unit="step", disable=not progress, dynamic_ncols=True)
    for step in bar:
        grads, (_, (loss, mtp_loss, loads)) = grad_fn(trainable, biases, next(batches), cfg.mtp_weight_at(step))
        for p, g in zip(trainable, grads):
            p.grad = g
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, cfg.clip_norm))
        lr = optimizer.param_groups[0]["lr"]
        with torch.no_grad():
            optimizer.step()
        schedule.step()
        # Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded.
        loads = loads.float()
        biases = [
            b + cfg.bias_update_rate * torch.sign(load.mean() - load) for b, load in zip(biases, loads)
        ]
        losses.append(float(loss))
        mtp_losses.append(float(mtp_loss))
        lrs.append(lr)
        smooth = losses[-1] if smooth is None else 0.98 * smooth + 0.02 * losses[-1]
        bar.set_postfix(loss=f"{smooth:.3f}", mtp=f"{mtp_losses[-1]:.3f}", lr=f"{lr:.2e}", gnorm=f"{grad_norm:.2f}")
    bar.close()
    elapsed = time.perf_counter() - start
    for p in trainable:
        p.grad = None
    loads = (loads / loads.sum(dim=-1, keepdim=True)).tolist()
    log = {"losses": losses, "mtp_losses": mtp_losses, "lrs": lrs, "train_seconds": elapsed,
           "final_expert_load_fractions": loads}
    params, mtp = layout.tree(trainable, biases)
    return params, mtp, log


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="model folder to write (default: the shipped one)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--threads", type=int, default=TrainConfig.threads,
                        help="torch CPU threads (default 1: on a CPU shared with other processes one thread "
                             "ran several times faster than two)")
    parser.add_argument("--mtp-layers", type=int, default=TrainConfig.mtp_layers, choices=(0, 1),
                        help="multi-token-prediction layers to train beside the model (default 1)")
    parser.add_argument("--model", type=json.loads, default={}, help="JSON overrides of the model config fields")
    parser.add_argument("--device", default="cpu", help="where to train (the shipped model is trained on cpu)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = TrainConfig(seed=args.seed, steps=args.steps, lr=args.lr, threads=args.threads, mtp_layers=args.mtp_layers,
                      model=args.model)
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
    mtp = init_mtp_params(config, params, cfg.seed) if cfg.mtp_layers else None
    num_params, num_mtp = count_parameters(params, mtp)
    say(f"model: {num_params / 1e6:.2f}M parameters (and {num_mtp / 1e6:.2f}M in its MTP layer); training "
        f"{cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens on {cfg.threads} thread(s)")
    params, mtp, log = train(params, train_windows, cfg, mtp=mtp, progress=not args.no_progress)
    fp32_ppl, _ = perplexity(params, heldout_windows, block_size=cfg.block_size)
    say(f"trained in {log['train_seconds']:.0f}s; held-out perplexity {fp32_ppl:.2f} (float32 weights before export)")

    bos, eos = tokenizer.token_to_id(data.BOS), tokenizer.token_to_id(data.EOS)
    save_checkpoint(args.out, params, tokenizer=tokenizer, extra_config={"bos_token_id": bos, "eos_token_id": eos},
                    mtp=mtp)
    # Every number below comes from the exported (bfloat16-stored) files, loaded back in float32.
    model = load_model(args.out, dtype=torch.float32, device="cpu", mtp=mtp is not None)
    say("exported; measuring the exported model")
    tail = log["losses"][-100:]
    metrics = {
        "command": " ".join(["python -m mla_func.demo.train", *(sys.argv[1:] if argv is None else argv)]),
        "train_config": asdict(cfg),
        "model_parameters": num_params,
        "mtp_parameters": num_mtp,
        "documents": {"train": len(train_docs), "heldout": len(heldout_docs)},
        "train_tokens_available": len(train_windows) * cfg.seq_len,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_seconds": round(log["train_seconds"], 1),
        "final_train_loss_mean_last_100_steps": sum(tail) / len(tail),
        "heldout_perplexity_fp32_before_export": fp32_ppl,
        "final_expert_load_fractions": log["final_expert_load_fractions"],
        "python": platform.python_version(),
        "torch": torch.__version__,
        **evaluate(model, docs, heldout_windows, seq_len=cfg.seq_len, block_size=cfg.block_size, seed=cfg.seed,
                    prompts=SAMPLE_PROMPTS),
        "loss_curve_every_50_steps": [round(x, 4) for x in log["losses"][::50]],
    }
    if mtp is not None:
        mtp_tail = log["mtp_losses"][-100:]
        metrics["final_train_mtp_loss_mean_last_100_steps"] = sum(mtp_tail) / len(mtp_tail)
        metrics["mtp_loss_curve_every_50_steps"] = [round(x, 4) for x in log["mtp_losses"][::50]]
    metrics["total_seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "training.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (args.out / "TRAINING.md").write_text(training_md(metrics, config))
    say(f"wrote {args.out}")
    print(f"held-out perplexity: {metrics['heldout_perplexity']:.2f} over {metrics['heldout_tokens']} tokens "
          f"(uniform would be {config.vocab_size})")
    for r in metrics.get("acceptance", {}).get("runs", []):
        print(f"  k={r['k']}: {r['accepted']} of {r['drafted']} drafts accepted ({r['rate']:.3f})")
    return metrics


if __name__ == "__main__":
    main()
    sys.exit(0)
