"""DeepSeek sparse attention kernels against the device's own copy bandwidth.

    python bench/dsa_kernels.py [--commit SHA] [--out bench/results]
    python bench/dsa_kernels.py --sweep      # time tile-size candidates instead (no result file)
    python bench/dsa_kernels.py --wgmma      # only the 128-head sparse decode and prefill, warpgroup MMA beside
                                             # its twin

Prints a table and writes bench/results/dsa-kernels/<gpu>/<date>-<commit>.json. The
ceiling is device-to-device copy bandwidth (bytes read plus written), measured
in the same run; each row's roofline time is the bytes it must move over that
bandwidth, and `t/t_copy` is its time over the roofline time.

Rows (bf16, block size 64, C = 512, R = 64, indexer 64 heads x 128 dims; batch 64,
and batch 8 at 128K as a decode step of a long-context batch would run them):
* sparse_mla_decode: B rows attend over their top-k selected latent rows; bytes
  = the selected rows + queries + outputs.
* index_topk: indexer scores over every cached position, then top-k; bytes = the
  indexer keys read (the figure the target is stated in), the scores' write and
  reads listed beside it; the scores alone, and their `tl.dot` twin's where the
  warpgroup-MMA kernel takes them.
* sparse_mla_prefill: a prefill chunk of one sequence through the same op (absorbed, each row its own
  top-k), 128 heads; against the bf16 matmul rate measured in the run.
* dsa_decode: the three kernels of one layer's sparse attention; bytes = the
  selected latent rows + the indexer keys read (+ queries, outputs); also at batch
  64 and 128 with random lengths up to 32K (serving batches: rows of unequal cost).
Timings are CUDA-graph replays of calls on other block tables (so no call finds
the previous one's rows in L2); eager timings (launches included, L2 flushed)
sit beside them.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from mla_func.kernels.gluon import dsa_indexer as gluon_indexer  # noqa: E402
from mla_func.kernels.triton import dsa_decode, dsa_indexer, dsa_topk  # noqa: E402
from mla_func.kernels.triton.decode import DecodeConfig, decode_flops  # noqa: E402

KV_LORA_RANK, ROPE_DIM = 512, 64
DIM = KV_LORA_RANK + ROPE_DIM
INDEX_HEADS, INDEX_DIM = 64, 128
BLOCK_SIZE = 64
TOP_K = 2048
BF16 = torch.bfloat16
TABLE_COPIES = 2


def _tables(num_rows, context, num_blocks, copies):
    """`copies` block tables [B, W] of distinct pages each (block 0 left out)."""
    width = context // BLOCK_SIZE
    return [(torch.randperm(num_blocks - 1, device="cuda")[: num_rows * width] + 1).to(torch.int32)
            .view(num_rows, width) for _ in range(copies)]


def _selected(num_rows, context):
    """[B, k] int32: k random positions of [0, context) per row, ascending (as top-k lists them)."""
    scores = torch.rand(num_rows, context, device="cuda")
    return scores.topk(TOP_K, dim=1).indices.sort(dim=1).values.to(torch.int32)


def _row(op, ms, num_bytes, ceilings, **fields):
    copy_ms = num_bytes / ceilings["copy"] * 1e3
    return dict(op=op, ms=ms, us=ms * 1e3, bytes=num_bytes, gb_s=num_bytes / ms / 1e6,
                pct_copy=100 * copy_ms / ms, roofline_ms=copy_ms, copy_time_ratio=ms / copy_ms, **fields)


def bench_sparse_decode(num_rows, context, num_heads, ceilings, config=None, num_splits=None, eager=True):
    num_blocks = num_rows * (context // BLOCK_SIZE) + 1
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, DIM, device="cuda", dtype=BF16)
    tables = _tables(num_rows, context, num_blocks, TABLE_COPIES)
    indices = _selected(num_rows, context)
    q = torch.randn(num_rows, num_heads, DIM, device="cuda", dtype=BF16)
    config = config or dsa_decode.sparse_launch_config(num_heads, KV_LORA_RANK, DIM - KV_LORA_RANK, q.device, False,
                                                       BF16, slots=num_rows * TOP_K)
    splits = num_splits or dsa_decode.sparse_mla_decode_num_splits(num_rows, num_heads, TOP_K, q.device, config)
    workspace = (torch.empty(num_rows, num_heads, splits, KV_LORA_RANK, device="cuda"),
                 torch.empty(num_rows, num_heads, splits, device="cuda"))

    def call(table):
        return dsa_decode.sparse_mla_decode(q, kv_cache, table, indices, softmax_scale=DIM ** -0.5,
                                            kv_lora_rank=KV_LORA_RANK, workspace=workspace,
                                            num_splits=splits, config=config)

    ms = common.time_graph([lambda t=t: call(t) for t in tables])
    num_bytes = dsa_decode.sparse_decode_bytes(num_rows, num_heads, TOP_K, DIM, KV_LORA_RANK, 2)
    flops = decode_flops(num_heads, num_rows * TOP_K, KV_LORA_RANK, DIM - KV_LORA_RANK)
    row = _row("sparse_mla_decode", ms, num_bytes, ceilings, batch=num_rows, context=context, heads=num_heads,
               top_k=TOP_K, splits=splits, bytes_counted="selected latent rows + queries + outputs",
               kernel=_kernel(config), flops=flops, tflop_s=flops / ms / 1e9)
    if eager:
        row["eager_ms"] = common.time_eager(lambda: call(tables[0]))
    return row


def _kernel(config):
    return "wgmma" if config.wgmma else "narrow" if config.narrow else "tl.dot"


def bench_sparse_prefill(num_tokens, context, num_heads, ceilings, config=None):
    """V3.2's prefill attention as the model runs it (`models.dsa.attention`: absorbed, every row its own
    top-k): a chunk of `num_tokens` rows at the end of one sequence of `context` positions, each row over
    top-2048 random positions of its causal prefix. Compute-bound at 128 heads: reported against the bf16
    matmul rate of the run."""
    width = context // BLOCK_SIZE
    num_blocks = width + 1
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, DIM, device="cuda", dtype=BF16)
    # One sequence: every row reads the same table (each row takes its own view of it by contract).
    tables = [t.expand(num_tokens, width).contiguous() for t in _tables(1, context, num_blocks, TABLE_COPIES)]
    positions = context - num_tokens + torch.arange(num_tokens, device="cuda")
    scores = torch.rand(num_tokens, context, device="cuda")
    scores[torch.arange(context, device="cuda")[None, :] > positions[:, None]] = -1.0
    indices = scores.topk(TOP_K, dim=1).indices.sort(dim=1).values.to(torch.int32)
    q = torch.randn(num_tokens, num_heads, DIM, device="cuda", dtype=BF16)
    config = config or dsa_decode.sparse_launch_config(num_heads, KV_LORA_RANK, DIM - KV_LORA_RANK, q.device, False,
                                                       BF16, slots=num_tokens * TOP_K)
    splits = dsa_decode.sparse_mla_decode_num_splits(num_tokens, num_heads, TOP_K, q.device, config)
    workspace = dsa_decode.sparse_mla_decode_workspace(num_tokens, num_heads, KV_LORA_RANK, TOP_K, q.device, config)

    def call(table):
        return dsa_decode.sparse_mla_decode(q, kv_cache, table, indices, softmax_scale=DIM ** -0.5,
                                            kv_lora_rank=KV_LORA_RANK, workspace=workspace, config=config)

    ms = common.time_graph([lambda t=t: call(t) for t in tables])
    flops = decode_flops(num_heads, num_tokens * TOP_K, KV_LORA_RANK, DIM - KV_LORA_RANK)
    num_bytes = dsa_decode.sparse_decode_bytes(num_tokens, num_heads, TOP_K, DIM, KV_LORA_RANK, 2)
    return _row("sparse_mla_prefill", ms, num_bytes, ceilings, tokens=num_tokens, context=context, heads=num_heads,
                top_k=TOP_K, splits=splits, kernel="wgmma" if config.wgmma else "tl.dot", flops=flops,
                tflop_s=flops / ms / 1e9, pct_matmul=100 * flops / ms * 1e3 / ceilings["matmul"],
                bytes_counted="selected latent rows + queries + outputs")


def _index_setup(num_rows, context):
    num_blocks = num_rows * (context // BLOCK_SIZE) + 1
    index_cache = torch.randn(num_blocks, BLOCK_SIZE, INDEX_DIM, device="cuda", dtype=BF16)
    index_q = torch.randn(num_rows, INDEX_HEADS, INDEX_DIM, device="cuda", dtype=BF16)
    head_weights = torch.randn(num_rows, INDEX_HEADS, device="cuda") * INDEX_HEADS ** -0.5
    key_lens = torch.full((num_rows,), context, dtype=torch.int32, device="cuda")
    scores = torch.empty(num_rows, context, device="cuda")
    indices = torch.empty(num_rows, TOP_K, dtype=torch.int32, device="cuda")
    return num_blocks, index_cache, index_q, head_weights, key_lens, scores, indices


def _topk_workspace(num_rows, context, topk_config=None, path=None):
    return dsa_topk.top_k_workspace(num_rows, context, "cuda", topk_config, path, k=TOP_K)


def _indexer_grid(num_rows, context, config=None):
    """The indexer's kernel at these shapes: the warpgroup-MMA one's programs, or the twin's chunks a row."""
    config = config or dsa_indexer.default_config(num_rows, context, "cuda")
    q = torch.empty(1, INDEX_HEADS, INDEX_DIM, device="cuda", dtype=BF16)
    if config.wgmma and gluon_indexer.applies(q, torch.empty(1, BLOCK_SIZE, INDEX_DIM, device="cuda", dtype=BF16)):
        return f"wgmma, {gluon_indexer.PROGRAMS_PER_SM} programs an SM"
    return f"{dsa_indexer.index_scores_num_chunks(num_rows, context, 'cuda', config)} chunks a row"


def _twin_config(num_rows, context):
    """The `tl.dot` indexer's tiles the op would take at these shapes without the warpgroup-MMA kernel."""
    return dataclasses.replace(dsa_indexer.default_config(num_rows, context, "cuda"), wgmma=False)


def bench_index_topk(num_rows, context, ceilings, config=None, topk_config=None, topk_chunks=None, eager=True,
                     topk_path=None):
    num_blocks, index_cache, index_q, head_weights, key_lens, scores, indices = _index_setup(num_rows, context)
    tables = _tables(num_rows, context, num_blocks, 1)
    topk_path = topk_path or ("passes" if topk_chunks else dsa_topk.top_k_path(num_rows, context, "cuda"))
    topk_workspace = None if topk_chunks else _topk_workspace(num_rows, context, topk_config, topk_path)

    def score(table):
        return dsa_indexer.index_scores(index_q, head_weights, index_cache, table, key_lens, out=scores,
                                        config=config)

    def select():
        return dsa_topk.top_k_indices(scores, key_lens, k=TOP_K, out=indices, workspace=topk_workspace,
                                      num_chunks=topk_chunks, config=topk_config, path=topk_path)

    score_ms = common.time_graph([lambda: score(tables[0])])
    twin_ms = common.time_graph([lambda: dsa_indexer.index_scores(index_q, head_weights, index_cache, tables[0],
                                                                   key_lens, out=scores,
                                                                   config=_twin_config(num_rows, context))])
    topk_ms = common.time_graph([select])
    ms = common.time_graph([lambda: (score(tables[0]), select())])
    key_bytes = num_rows * context * INDEX_DIM * 2
    score_bytes = num_rows * context * 4
    row = _row("index_topk", ms, key_bytes, ceilings, batch=num_rows, context=context, index_heads=INDEX_HEADS,
               index_dim=INDEX_DIM, top_k=TOP_K, score_ms=score_ms, topk_us=topk_ms * 1e3,
               score_pct_copy=100 * key_bytes / ceilings["copy"] * 1e3 / score_ms,
               score_ms_twin=twin_ms, score_pct_copy_twin=100 * key_bytes / ceilings["copy"] * 1e3 / twin_ms,
               score_bytes=score_bytes, topk_gb_s_one_pass=score_bytes / topk_ms / 1e6,
               indexer_grid=_indexer_grid(num_rows, context, config),
               topk_path=topk_path,
               topk_chunks=topk_chunks or dsa_topk.top_k_num_chunks(num_rows, context, index_q.device, topk_config,
                                                                    topk_path),
               bytes_counted="indexer keys read (scores written once and read by top-k not counted)")
    if eager:
        row["eager_ms"] = common.time_eager(lambda: (score(tables[0]), select()))
    return row


def bench_dsa_decode(num_rows, context, num_heads, ceilings, eager=True, ragged=False):
    """Indexer scores + top-k + sparse decode: one layer's sparse attention for B decode rows, each of
    `context` keys, or of random lengths in [1, context] when `ragged` (a serving batch)."""
    num_blocks, index_cache, index_q, head_weights, key_lens, scores, indices = _index_setup(num_rows, context)
    if ragged:
        lengths = torch.randint(1, context + 1, (num_rows,), generator=torch.Generator().manual_seed(num_rows))
        key_lens.copy_(lengths.to(torch.int32))
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, DIM, device="cuda", dtype=BF16)
    tables = _tables(num_rows, context, num_blocks, TABLE_COPIES)
    q = torch.randn(num_rows, num_heads, DIM, device="cuda", dtype=BF16)
    # The workspace's splits are those of the kernel the op takes at these shapes.
    config = dsa_decode.sparse_op_config(q, kv_cache, KV_LORA_RANK, slots=num_rows * TOP_K)
    workspace = dsa_decode.sparse_mla_decode_workspace(num_rows, num_heads, KV_LORA_RANK, TOP_K, q.device, config)
    topk_workspace = _topk_workspace(num_rows, context)

    def call(table):
        dsa_indexer.index_scores(index_q, head_weights, index_cache, table, key_lens, out=scores)
        dsa_topk.top_k_indices(scores, key_lens, k=TOP_K, out=indices, workspace=topk_workspace)
        return dsa_decode.sparse_mla_decode(q, kv_cache, table, indices, softmax_scale=DIM ** -0.5,
                                            kv_lora_rank=KV_LORA_RANK, workspace=workspace)

    ms = common.time_graph([lambda t=t: call(t) for t in tables])
    visible = key_lens.long().cpu()
    key_bytes = int(visible.sum()) * INDEX_DIM * 2
    # A row of fewer keys than k selects them all.
    latent_bytes = dsa_decode.sparse_decode_bytes(num_rows, num_heads, TOP_K, DIM, KV_LORA_RANK, 2)
    latent_bytes -= int((TOP_K - visible.clamp(max=TOP_K)).sum()) * DIM * 2
    row = _row("dsa_decode", ms, key_bytes + latent_bytes, ceilings, batch=num_rows, context=context,
               heads=num_heads, top_k=TOP_K, index_key_bytes=key_bytes, latent_bytes=latent_bytes,
               lengths="random in [1, context]" if ragged else "context",
               indexer_grid=_indexer_grid(num_rows, context),
               bytes_counted="indexer keys + selected latent rows + queries + outputs")
    if eager:
        row["eager_ms"] = common.time_eager(lambda: call(tables[0]))
    return row


def sweep(ceilings):
    """Tile candidates, each row printed when timed (a sweep cut short still reports what it measured)."""
    rows = []
    print("\n== sweep ==", flush=True)
    sparse = [(16, DecodeConfig(16, n, w, s), splits) for n in (32, 64) for w in (4, 8) for s in (1, 2, 3)
              for splits in (None, 2, 4)]
    sparse += [(128, DecodeConfig(h, n, 8, s), splits) for h in (32, 64) for n in (32, 64) for s in (1, 2)
               for splits in (None, 1, 2)]
    for heads, cfg, splits in sparse:
        try:
            r = bench_sparse_decode(64, 32 * 1024, heads, ceilings, config=cfg, num_splits=splits, eager=False)
        except Exception as exc:  # a config that does not compile is a sweep result, not a failure
            r = dict(op="sparse_mla_decode", error=repr(exc)[:120])
        common.sweep_row(rows, r, config=str(cfg), case=f"sparse B64 H{heads} k2048")
    for cfg in [dsa_indexer.IndexerConfig(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]:
        try:
            r = bench_index_topk(64, 128 * 1024, ceilings, config=cfg, eager=False)
        except Exception as exc:
            r = dict(op="index_topk", error=repr(exc)[:120])
        rows.append(dict(r, config=str(cfg), case="index B64 ctx128K"))
    for tcfg in [dsa_topk.TopKConfig(b, w) for b in (1024, 2048, 4096, 8192) for w in (4, 8, 16)]:
        try:
            r = bench_index_topk(64, 128 * 1024, ceilings, topk_config=tcfg, eager=False)
        except Exception as exc:
            r = dict(op="index_topk", error=repr(exc)[:120])
        rows.append(dict(r, config=str(tcfg), case="topk B64 ctx128K"))
    for num_rows, chunk_counts in ((64, (1, 2, 4, 8, 16)), (8, (4, 16, 32))):
        for chunks in chunk_counts:
            r = bench_index_topk(num_rows, 128 * 1024, ceilings, topk_chunks=chunks, eager=False)
            rows.append(dict(r, config=f"{chunks} chunks", case=f"topk B{num_rows} ctx128K"))
    for num_rows in (1, 8, 64):
        r = bench_index_topk(num_rows, 128 * 1024, ceilings, topk_path="synced", eager=False)
        rows.append(dict(r, config=f"synced, {r['topk_chunks']} chunks", case=f"topk B{num_rows} ctx128K"))
    common.print_table(rows, [("case", "case"), ("config", "config"), ("splits", "splits"), ("us", "us"),
                              ("score_ms", "score ms"), ("topk_us", "topk us"), ("pct_copy", "%copy"),
                              ("copy_time_ratio", "t/t_copy"), ("error", "error")])
    return rows


def narrow_rows(ceilings):
    """16 heads, top-2048, B64 x 32K and x 128K: the sparse decode the op takes (on Hopper the keys-as-rows kernel)
    beside its `tl.dot` twin."""
    rows = []
    twin = dsa_decode.sparse_launch_config(16, KV_LORA_RANK, DIM - KV_LORA_RANK, torch.device("cuda"), False, BF16,
                                           wgmma=False)
    for context in (32 * 1024, 128 * 1024):
        pair = [bench_sparse_decode(64, context, 16, ceilings, config=config, eager=config is None)
                for config in (None, twin)]
        pair[0]["speedup_vs_twin"] = pair[1]["ms"] / pair[0]["ms"]
        rows += pair
        torch.cuda.empty_cache()
    return rows


def wgmma_rows(ceilings):
    """128 heads, top-2048: the warpgroup-MMA sparse decode beside its `tl.dot` twin, B64 and B128 x 32K, and the
    prefill of 1024 and 4096 tokens of one 32K sequence (the same op, every row its own top-k)."""
    rows = []
    twin = dsa_decode.sparse_launch_config(128, KV_LORA_RANK, DIM - KV_LORA_RANK, torch.device("cuda"), False, BF16,
                                           wgmma=False)
    for num_rows in (64, 128):
        pair = [bench_sparse_decode(num_rows, 32 * 1024, 128, ceilings, config=config, eager=False)
                for config in (None, twin)]
        pair[0]["speedup_vs_twin"] = pair[1]["ms"] / pair[0]["ms"]
        rows += pair
        torch.cuda.empty_cache()
    for num_tokens in (1024, 4096):
        pair = [bench_sparse_prefill(num_tokens, 32 * 1024, 128, ceilings, config=config) for config in (None, twin)]
        pair[0]["speedup_vs_twin"] = pair[1]["ms"] / pair[0]["ms"]
        rows += pair
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    parser = common.kernel_bench_parser(__doc__)
    parser.add_argument("--wgmma", action="store_true",
                        help="only the 128-head sparse decode and prefill: the warpgroup-MMA kernel beside its "
                             "tl.dot twin")
    args = parser.parse_args(argv)
    result, ceilings = common.kernel_bench_run(
        "bench/dsa_kernels.py", args.commit, matmul=not args.sweep,
        timing=common.GRAPH_REPLAY_TIMING,
        targets="sparse decode (dsa_decode rows): t/t_copy <= 1.3; index_topk: %copy >= 60")
    if args.sweep:
        sweep(ceilings)
        return
    if args.wgmma:
        result["rows"] += wgmma_rows(ceilings)
        _report(result, args.out)
        return

    result["rows"] += narrow_rows(ceilings)
    result["rows"] += wgmma_rows(ceilings)
    for num_rows, context in ((64, 32 * 1024), (64, 128 * 1024), (8, 128 * 1024)):
        result["rows"].append(bench_index_topk(num_rows, context, ceilings))
        torch.cuda.empty_cache()
    for num_rows, context, ragged in ((64, 32 * 1024, False), (64, 128 * 1024, False), (8, 128 * 1024, False),
                                      (64, 32 * 1024, True), (128, 32 * 1024, True)):
        result["rows"].append(bench_dsa_decode(num_rows, context, 16, ceilings, ragged=ragged))
        torch.cuda.empty_cache()

    _report(result, args.out)


def _report(result, out):
    path = common.write_json(result, out, "dsa-kernels")
    rows = []
    for c in result["rows"]:
        heads = f" H{c['heads']}" if "heads" in c else f" Hi{c['index_heads']}x{c['index_dim']}"
        ragged = ", ragged" if c.get("lengths", "context") != "context" else ""
        size = f"B{c['batch']}" if "batch" in c else f"T{c['tokens']}"
        rows.append(dict(c, shape=f"{size} ctx{c['context'] // 1024}K{heads} k{c['top_k']}{ragged}"))
    print(f"\n{result['gpu']}  commit {result['commit'][:12]}  copy {result['copy_bandwidth_gb_s']:.0f} GB/s  "
          f"-> {path}")
    common.print_table(rows, [("op", "op"), ("shape", "shape"), ("splits", "splits"), ("us", "us"),
                              ("eager_ms", "eager ms"), ("roofline_ms", "roofline ms"), ("gb_s", "GB/s"),
                              ("pct_copy", "%copy"), ("copy_time_ratio", "t/t_copy"), ("kernel", "kernel"),
                              ("tflop_s", "TFLOP/s"), ("pct_matmul", "%mm"), ("speedup_vs_twin", "x twin"),
                              ("score_ms", "score ms"), ("score_ms_twin", "twin ms"), ("topk_us", "topk us"),
                              ("topk_path", "top-k"), ("indexer_grid", "indexer")])


if __name__ == "__main__":
    main()
