"""What a training run measures on the exported model: perplexity, samples and, with an MTP layer, how
well it drafts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mla_func.core.model import Model
from mla_func.demo import data
from mla_func.demo.lm import perplexity
from mla_func.demo.report import samples
from mla_func.demo.speculation import speculation_report


def eval_subset_documents() -> list[data.Document]:
    """The held-out documents of `data.EVAL_SUBSET_FILES`: the quick check the tests repeat."""
    root = data.stdlib_root()
    files = [root / f for f in data.EVAL_SUBSET_FILES if (root / f).is_file()]
    return [d for d in data.stdlib_documents(files, root) if d.heldout]


def evaluate(model: Model, docs: Sequence[data.Document], heldout_windows: Sequence[Sequence[int]], *,
             seq_len: int, block_size: int, seed: int, prompts: Sequence[str]) -> dict[str, Any]:
    """training.json's measurements of `model` (with its tokenizer): held-out perplexity over
    `heldout_windows`, the eval subset's, greedy and sampled continuations of `prompts`, and
    with `model.mtp` the MTP layer's scores and acceptance rates (`speculation_report` over `docs`)."""
    heldout_ppl, heldout_tokens = perplexity(model.params, heldout_windows, block_size=block_size)
    subset_docs = eval_subset_documents()
    subset_windows = data.pack(data.encode_documents(model.tokenizer, subset_docs), seq_len)
    subset_ppl, subset_tokens = perplexity(model.params, subset_windows, block_size=block_size)
    out: dict[str, Any] = {
        "heldout_perplexity": heldout_ppl,
        "heldout_tokens": heldout_tokens,
        "eval_subset": {"files": list(data.EVAL_SUBSET_FILES), "documents": len(subset_docs),
                        "tokens": subset_tokens, "perplexity": subset_ppl,
                        "text_sha256": data.text_digest(subset_docs)},
        "samples_greedy": samples(model, prompts, max_new_tokens=24, temperature=0.0, seed=seed),
        "samples_temperature_0.8": samples(model, prompts, max_new_tokens=40, temperature=0.8, seed=seed),
    }
    if model.mtp is not None:
        out.update(speculation_report(model, docs, heldout_windows, block_size=block_size))
    return out
