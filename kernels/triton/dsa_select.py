"""The indexer's scores and their top-k as one op: the scoring kernel does top-k's first pass.

`index_top_k` gives what `top_k_indices(index_scores(...))` gives, with one pass over
the scores fewer: top-k's first radix pass histograms the top byte of every visible
score, and the scoring kernel has each score in registers as it stores it. The
indexer's programs are cut to fit inside top-k's chunks (a power-of-two count of them
make up one), and each adds its share of its chunk's histogram atomically into the
zeroed first-pass slot of top-k's workspace.
"""

from __future__ import annotations

import torch
import triton

from ..checks import check_shape
from .dsa_indexer import IndexerConfig, index_scores_num_chunks, indexer_config, scores_by_chunks
from .dsa_topk import SelectPlan, TopKConfig, select, select_plan, top_k_workspace


def indexer_chunks_per_select_chunk(plan: SelectPlan, num_rows: int, num_cols: int, device: torch.device,
                                    config: IndexerConfig) -> int:
    """Indexer programs per top-k chunk: a power of two near the indexer's own chunk count, each a
    whole number of key tiles (static shapes and the device only)."""
    wanted = triton.cdiv(index_scores_num_chunks(num_rows, num_cols, device, config), plan.chunks)
    split = 1
    while split < wanted and plan.chunk_len % (2 * split * config.block_n) == 0:
        split *= 2
    return split


def index_top_k(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    *,
    k: int,
    out: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    config: IndexerConfig | None = None,
    topk_config: TopKConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k best-scored positions of its paged indexer cache, and the scores.

    q [T, Hi, Di], head_weights [T, Hi] float32, index_cache [num_blocks, bs, Di],
    block_table [T, W] int32, key_lens [T] int32: as `index_scores`; k >= 1.
    out:       [T, k] int32 for the indices, or None
    scores:    [T, W * bs] float32 for the scores, or None
    workspace: [T, 4, P + 1, 256] int32 from `top_k_workspace(T, W * bs, ...)`, or None
    returns    (indices [T, k] int32 as `top_k_indices` lists them, scores [T, W * bs] float32
               as `index_scores` computes them).
    """
    num_rows = q.shape[0]
    num_cols = block_table.shape[1] * index_cache.shape[1]
    device = q.device
    config = config or indexer_config(device)
    plan = select_plan(num_rows, num_cols, device, topk_config)
    if workspace is None:
        workspace = top_k_workspace(num_rows, num_cols, device, plan.config)
    else:
        check_shape("workspace", workspace, (num_rows, None, plan.chunks + 1, None))
    split = indexer_chunks_per_select_chunk(plan, num_rows, num_cols, device, config)
    first_pass = workspace[:, 0, : plan.chunks]                                           # [T, P, 256]
    first_pass.zero_()
    scores = scores_by_chunks(q, head_weights, index_cache, block_table, key_lens,
                              keys_per_chunk=plan.chunk_len // split, out=scores, config=config,
                              digits=first_pass, digits_chunk_len=plan.chunk_len)
    indices = select(scores, key_lens, k=k, plan=plan, out=out, workspace=workspace, first_pass_done=True)
    return indices, scores
