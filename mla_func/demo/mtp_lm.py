"""DeepSeek-V3's multi-token-prediction loss on packed windows, through the forward mla-func serves with.

For a window w of L + 1 tokens the model's step feeds w[0:L] at positions 0..L-1 and
leaves the normalised hidden state h_p at each. The MTP layer (depth 1) then runs as the
engine's drafter does in its catch-up step (`mla_func.serving.speculative`): its row at position
p is fed the token w[p+1] and h_p, over a cache of its own addressed by the same
positions, and predicts w[p+2]:

    x_p    = eh_proj [enorm(embed(w[p+1])); hnorm(h_p)]
    g_p    = shared_head.norm(DecoderLayer(x_0..x_p))          (causal over the MTP cache)
    P_p+2  = softmax(head(g_p))

Rows p = 0..L-2 have a target inside the window. The MTP loss is the mean cross entropy
over them; training minimises main + lambda * MTP (DeepSeek-V3, sec. 2.2), and the hidden
states are not detached, so the MTP loss also trains the model's layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mla_func.core.forward import forward, forward_outputs
from mla_func.core.model import Model
from mla_func.core.params import Params
from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.core.prepare import init_state, plan_step
from mla_func.demo.lm import windows_step
from mla_func.kernels import Ops
from mla_func.models.mtp.layer import drafter_params, mtp_layer
from mla_func.models.mtp.params import MTPParams


def mtp_logits(params: Params, mtp: MTPParams, windows: Sequence[Sequence[int]], hidden: torch.Tensor, *,
               block_size: int, copy: bool, ops: Ops | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer's logits of every row with a target, and the targets.

    windows: B windows of L + 1 tokens; hidden [B * L, D] the model's normalised hidden states
             of the windows' step (`lm.windows_step`), row b * L + p for position p of window b.
    returns  (logits [B * (L - 1), V] float32, targets [B * (L - 1)] int64), row b * (L - 1) + p
             predicting w_b[p + 2].
    """
    config, length = params.config, len(windows[0]) - 1
    blocks_per_seq = -(-(length - 1) // block_size)
    seqs = []
    for b, window in enumerate(windows):
        first = 1 + b * blocks_per_seq  # block 0 is the cache's scratch block
        seqs.append(SeqPlan(tuple(window[1:-1]), 0, tuple(range(first, first + blocks_per_seq)), length - 1))
    kind = mtp_layer(config)
    # The drafter's own one-layer cache, fresh: the loss is a pure function of the windows.
    state = init_state(config, num_blocks=1 + len(windows) * blocks_per_seq, block_size=block_size,
                       dtype=params.embed.dtype, device=params.embed.device, layers=(kind,))
    batch, mode = plan_step(config, state, StepPlan(prefill=tuple(seqs)), backend="torch")
    fed = hidden.view(len(windows), length, -1)[:, : length - 1].reshape(-1, hidden.shape[-1])   # [B * (L - 1), D]
    drafter = drafter_params(Model(config=config, params=params, mtp=mtp))
    logits, _ = forward(drafter, state, replace(batch, hidden=fed), mode, copy=copy, ops=ops, layers=(kind,))
    targets = torch.tensor([t for w in windows for t in w[2:]], dtype=torch.int64, device=params.embed.device)
    return logits[: mode.num_logits], targets


def windows_losses(params: Params, mtp: MTPParams | None, windows: Sequence[Sequence[int]], *, block_size: int,
                   ops: Ops | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean next-token cross entropy, mean next-next-token cross entropy of the MTP layer or None
    without one), nats, scalars; differentiable in params and mtp (caches written out of place)."""
    state, batch, mode, targets = windows_step(params.config, windows, block_size=block_size,
                                               device=params.embed.device)
    out, _ = forward_outputs(params, state, batch, mode, copy=True, ops=ops, return_hidden=mtp is not None)
    main = F.cross_entropy(out.logits[: mode.num_logits], targets)
    if mtp is None or out.hidden is None:
        return main, None
    logits, mtp_targets = mtp_logits(params, mtp, windows, out.hidden[: mode.num_logits], block_size=block_size,
                                     copy=True, ops=ops)
    return main, F.cross_entropy(logits, mtp_targets)


@dataclass(frozen=True, slots=True)
class MTPScores:
    """Held-out scores of an MTP layer, teacher-forced on packed windows.

    loss:      mean cross entropy of w[p+2] from the MTP row p (nats)
    accuracy:  fraction of rows whose argmax is w[p+2]
    agreement: fraction of rows whose argmax equals the model's own argmax at p + 1, the
               greedy draft's acceptance when the model's text is the held-out text
    next_token_accuracy: fraction of the model's rows p + 1 whose argmax is w[p+2], for scale
    rows:      rows scored
    """

    loss: float
    accuracy: float
    agreement: float
    next_token_accuracy: float
    rows: int


@torch.no_grad()
def mtp_scores(model: Model, windows: Sequence[Sequence[int]], *, batch_size: int = 4,
               block_size: int = 64) -> MTPScores:
    """`MTPScores` of `model.mtp` over `windows` (lists of L + 1 token ids), `batch_size` windows a step."""
    if model.mtp is None:
        raise ValueError("mtp_scores: the model has no MTP layer; load it with load_model(..., mtp=True)")
    if not windows:
        raise ValueError("mtp_scores: no windows to score")
    params, length = model.params, len(windows[0]) - 1
    nll, hits, agree, main_hits, rows = 0.0, 0, 0, 0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        state, batch, mode, _ = windows_step(model.config, chunk, block_size=block_size, device=model.device)
        out, _ = forward_outputs(params, state, batch, mode, return_hidden=True)
        if out.hidden is None:
            raise RuntimeError("mtp_scores: the forward returned no hidden states")
        logits, targets = mtp_logits(params, model.mtp, chunk, out.hidden[: mode.num_logits],
                                     block_size=block_size, copy=False)
        # The model's own guess for the same token: its row p + 1 of each window.
        main = out.logits[: mode.num_logits].view(len(chunk), length, -1)[:, 1:].reshape(-1, logits.shape[-1])
        guess = logits.argmax(dim=-1)
        nll += float(F.cross_entropy(logits.double(), targets, reduction="sum"))
        hits += int((guess == targets).sum())
        agree += int((guess == main.argmax(dim=-1)).sum())
        main_hits += int((main.argmax(dim=-1) == targets).sum())
        rows += targets.numel()
    return MTPScores(loss=nll / rows, accuracy=hits / rows, agreement=agree / rows,
                     next_token_accuracy=main_hits / rows, rows=rows)
