"""What a training run reports: samples of the trained model and the model folder's TRAINING.md."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mla_func.core.config import ModelConfig
from mla_func.core.model import Model
from mla_func.serving.engine import Engine
from mla_func.serving.sampling import SamplingParams


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


def training_md(m: dict, config: ModelConfig) -> str:
    c = m["train_config"]
    lines = [
        "# The demo model",
        "",
        "A DeepSeek-V3-architecture model (MLA with a low-rank query, MoE with a shared",
        "expert, sigmoid noaux_tc routing) trained by mla-func's own pure forward under",
        "`torch.func.grad_and_value`, on the docstrings of Python's standard library.",
        *(["One multi-token-prediction (MTP) layer is trained beside it with DeepSeek-V3's MTP loss;",
           "`load_model(..., mtp=True)` serves it as the drafter of speculative decoding."]
          if c.get("mtp_layers") else []),
        "",
        "Reproduce (about the time below on a 2-core CPU shared with other work):",
        "",
        f"    {m['command']}",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {m['model_parameters'] / 1e6:.2f}M (tied embeddings; weights stored in bfloat16)"
        + (f", and {m['mtp_parameters'] / 1e6:.2f}M in the MTP layer |" if m.get("mtp_parameters") else " |"),
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
        *_mtp_rows(m, config),
        f"| final train loss | {m['final_train_loss_mean_last_100_steps']:.3f} nats (next token; mean of the last "
        "100 steps) |",
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
    lines += _speculation_lines(m)
    lines += ["", "All numbers are in `training.json`, written by the same run.", ""]
    return "\n".join(lines)


def _mtp_rows(m: dict, config: ModelConfig) -> list[str]:
    c = m["train_config"]
    if not c.get("mtp_layers"):
        return []
    late = round(c["mtp_late_fraction"] * c["steps"])
    return [
        "| MTP | one layer, DeepSeek-V3's depth-1 module (enorm, hnorm, eh_proj, an MoE decoder layer, "
        "shared_head norm; the embedding and head are the model's), stored as "
        f"`model.layers.{config.num_hidden_layers}.*` |",
        f"| MTP loss weight | {c['mtp_weight']} for steps 0-{late - 1}, {c['mtp_weight_late']} after (DeepSeek-V3's "
        "values, which it switched after about 68% of its tokens) |",
        f"| final train MTP loss | {m['final_train_mtp_loss_mean_last_100_steps']:.3f} nats (token t+2; mean of the "
        "last 100 steps) |",
    ]


def _speculation_lines(m: dict) -> list[str]:
    if "mtp_heldout" not in m:
        return []
    s, a = m["mtp_heldout"], m["acceptance"]
    lines = [
        "",
        "## The MTP layer as a drafter",
        "",
        f"Teacher-forced on the held-out windows ({s['rows']} rows, each predicting token t+2 from",
        "the model's hidden state at t and the embedding of token t+1):",
        "",
        f"- MTP loss **{s['loss']:.3f}** nats (perplexity {math.exp(s['loss']):.1f});",
        f"- next-next-token accuracy **{s['accuracy']:.3f}** (the model's own next-token accuracy on the same "
        f"targets: {s['next_token_accuracy']:.3f});",
        f"- the MTP layer's argmax equals the model's own argmax one position later in **{s['agreement']:.3f}**",
        "  of the rows (the event that accepts a greedy first draft, here on held-out text rather than",
        "  on the model's own).",
        "",
        "Greedy speculative decoding through the engine (`Engine(model, speculative_tokens=k)`,",
        f"`engine.speculative_stats`) on {a['prompts']} held-out prompts (the first {a['prompt_tokens']} tokens "
        f"of the first {a['prompts']}",
        f"held-out documents longer than that), {a['max_tokens']} tokens each (past <|eos|>); the tokens equal "
        "those",
        "of decoding without drafts for every k. Drafts 2 and 3 of a step come from the MTP layer",
        "applied again to its own output, as serving engines run DeepSeek's one layer:",
        "",
        "| k | drafts | accepted | acceptance rate |",
        "|---|---|---|---|",
    ]
    for r in a["runs"]:
        lines.append(f"| {r['k']} | {r['drafted']} | {r['accepted']} | **{r['rate']:.3f}** |")
    lines += ["", "Reproduce these from the shipped files with", "", "    python -m mla_func.demo.speculation"]
    return lines
