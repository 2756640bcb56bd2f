"""How well the demo model's MTP layer drafts: greedy speculative decoding on held-out prompts, and its
teacher-forced held-out scores.

    python -m mla_func.demo.speculation              # the shipped model
    python -m mla_func.demo.speculation --model DIR  # another trained folder

The prompts are the opening tokens of held-out documents (those `data.is_heldout` keeps
out of training), in the documents' fixed order. Each k runs every prompt through the
engine (`Engine(..., speculative_tokens=k)`) greedily, checks the tokens against decoding
without drafts, and reads `engine.speculative_stats`: drafts proposed and accepted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mla_func.core.model import Model
from mla_func.demo import MODEL_DIR, data
from mla_func.demo.mtp_lm import mtp_scores
from mla_func.models.load import load_model
from mla_func.serving.engine import Engine
from mla_func.serving.sampling import SamplingParams

PROMPTS = 64         # held-out documents whose openings are the prompts
PROMPT_TOKENS = 16   # tokens of each prompt, <|bos|> included
MAX_TOKENS = 32      # greedy tokens generated for each prompt
KS = (1, 2, 3)


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Greedy speculative decoding with k drafts a step over some prompts."""

    k: int
    prompts: int
    generated: int   # tokens generated in all (the same with and without drafts)
    drafted: int     # drafts proposed (k a verify row, fewer where a request ends within k)
    accepted: int    # drafts accepted

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


def heldout_prompts(tokenizer: Any, docs: Sequence[data.Document], *, count: int = PROMPTS,
                    prompt_tokens: int = PROMPT_TOKENS) -> list[list[int]]:
    """The first `prompt_tokens` token ids (<|bos|> first) of the first `count` held-out documents of
    `docs` that are longer than that. ValueError when fewer are."""
    prompts = []
    for ids in data.encode_documents(tokenizer, [d for d in docs if d.heldout]):
        if len(ids) > prompt_tokens + 1:  # more text than the prompt, besides <|eos|>
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"heldout_prompts: {len(prompts)} held-out documents have over {prompt_tokens} tokens, "
                     f"{count} asked for")


def measure_acceptance(model: Model, prompts: Sequence[Sequence[int]], ks: Sequence[int] = KS, *,
                       max_tokens: int = MAX_TOKENS, max_num_seqs: int = 16) -> list[Acceptance]:
    """`Acceptance` of each k in `ks` for greedy decoding of `prompts` (token id lists), `max_tokens`
    tokens each, past <|eos|> (a fixed count of tokens, the text the model goes on to write).

    Raises RuntimeError if any k gives other tokens than decoding without drafts.
    """
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [list(p) for p in prompts]
    want = [c.raise_for_error().token_ids for c in Engine(model, graphs=False, max_num_seqs=max_num_seqs)
            .generate(batch, params)]
    out = []
    for k in ks:
        engine = Engine(model, graphs=False, max_num_seqs=max_num_seqs, speculative_tokens=k)
        got = [c.raise_for_error().token_ids for c in engine.generate(batch, params)]
        if got != want:
            wrong = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise RuntimeError(f"measure_acceptance: k={k} changed the greedy tokens of prompt {wrong}: "
                               f"{list(got[wrong])} instead of {list(want[wrong])}")
        stats = engine.speculative_stats
        out.append(Acceptance(k=k, prompts=len(batch), generated=sum(len(t) for t in got), drafted=stats.drafted,
                              accepted=stats.accepted))
    return out


def speculation_report(model: Model, docs: Sequence[data.Document], windows: Sequence[Sequence[int]], *,
                       block_size: int = 64) -> dict[str, Any]:
    """The MTP layer's held-out scores over `windows` and the acceptance of k = 1, 2, 3 on prompts
    from `docs` (every document; the held-out ones are picked here), as training.json records them."""
    scores = mtp_scores(model, windows, block_size=block_size)
    runs = measure_acceptance(model, heldout_prompts(model.tokenizer, docs))
    return {
        "mtp_heldout": asdict(scores),
        "acceptance": {"prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                       "runs": [{**asdict(r), "rate": r.rate} for r in runs]},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="trained model folder (default: the shipped one)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, mtp=True, dtype=torch.float32, device="cpu")
    recorded = json.loads((args.model / "training.json").read_text())["train_config"]
    docs = data.stdlib_documents()
    windows = data.pack(data.encode_documents(model.tokenizer, [d for d in docs if d.heldout]), recorded["seq_len"])
    report = speculation_report(model, docs, windows, block_size=recorded["block_size"])
    s = report["mtp_heldout"]
    print(f"MTP layer on {s['rows']} held-out rows: loss {s['loss']:.3f} nats, next-next-token accuracy "
          f"{s['accuracy']:.3f}, agreement with the model's next guess {s['agreement']:.3f} "
          f"(the model's next-token accuracy {s['next_token_accuracy']:.3f})")
    for r in report["acceptance"]["runs"]:
        print(f"k={r['k']}: {r['accepted']} of {r['drafted']} drafts accepted ({r['rate']:.3f}), "
              f"{r['generated']} tokens over {r['prompts']} prompts")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
