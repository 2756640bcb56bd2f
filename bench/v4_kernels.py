"""DeepSeek-V4 decode kernels against the device's own copy bandwidth.

    python bench/v4_kernels.py [--commit SHA] [--out bench/results]
    python bench/v4_kernels.py --sweep      # time tile-size candidates instead (no result file)

Prints a table (last) and writes bench/results/v4-kernels/<gpu>/<date>-<commit>.json. The
ceiling is device-to-device copy bandwidth (bytes read plus written), measured in
the same run; each row's roofline time is the bytes it must move over that
bandwidth, and `t/t_copy` is its time over the roofline time.

Rows (v4-mini's shapes: bf16, 64 heads of 512, window 128, CSA 4:1 with a 64 x 128
indexer keeping 512 entries, HCA 128:1, block size 64), B in {1, 64, 128} decode
rows x context {8K, 64K}:
* hca_attention: window + every complete entry (context / 128); bytes = the window's
  keys + the entries + queries + outputs.
* csa_attention: window + the top-512 entries; bytes = the window + the selected entries
  + queries + outputs.
* csa_decode: the indexer's scores over every complete entry (context / 4 keys of 128),
  its top-k and the attention: one CSA layer's attention for B decode rows; bytes =
  indexer keys + window + selected entries + queries + outputs.
* compress_csa / compress_hca: every row completes an entry (the compressor's decode-time
  update at its most expensive step); bytes = the block's inputs read + the entry written.
* hca_attention_fp8 / csa_attention_fp8 (B 1 and 64, 64K): the same attention over FP8 key
  caches (`kv_cache_dtype="fp8"`: 448 e4m3 values, 4 float32 scales, 64 bf16 rope values a key,
  592 bytes against 1,024); bytes counted at that size; `bf16_over_fp8` is the bf16 cache's row
  time (its op as called, measured just before) over this one.
Timings are CUDA-graph replays of calls on other block tables; eager timings (launches
included, L2 flushed) sit beside them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from mla_func.kernels.latent_cache import FP8LatentCache, scale_groups  # noqa: E402
from mla_func.kernels.reference.cache import quantized_cache  # noqa: E402
from mla_func.kernels.triton import dsa_indexer, dsa_topk, v4_attention, v4_compress  # noqa: E402
from mla_func.kernels.triton.decode import DecodeConfig  # noqa: E402

HEADS, HEAD_DIM, WINDOW = 64, 512, 128
CSA_RATE, HCA_RATE, TOP_K = 4, 128, 512
INDEX_HEADS, INDEX_DIM = 64, 128
ROPE_PAIRS = 32
BLOCK_SIZE = 64
BF16 = torch.bfloat16
TABLE_COPIES = 2
BATCHES = (1, 64, 128)
CONTEXTS = (8 * 1024, 64 * 1024)
FP8_BATCHES = (1, 64)
# Bytes of one key in an FP8 cache: the non-rotated values in e4m3, a float32 scale a 128, the rope values in bf16.
FP8_KEY_BYTES = (HEAD_DIM - 2 * ROPE_PAIRS) + 4 * scale_groups(HEAD_DIM - 2 * ROPE_PAIRS) + 2 * 2 * ROPE_PAIRS


def _pages(num_rows: int, width: int, pool: int) -> torch.Tensor:
    """[B, width] int32 distinct random pages of [1, pool)."""
    return (torch.randperm(pool - 1, device="cuda")[: num_rows * width] + 1).to(torch.int32).view(num_rows, width)


def _window_tables(num_rows: int, context: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The window cache and tables whose last pages (the window's) are real; earlier entries point at block 0,
    which the kernel never reads (those positions are outside every window)."""
    live = -(-WINDOW // BLOCK_SIZE) + 1
    width = context // BLOCK_SIZE
    pool = num_rows * live * TABLE_COPIES + 1
    cache = torch.randn(pool, BLOCK_SIZE, HEAD_DIM, device="cuda", dtype=BF16)
    tables = []
    for _ in range(TABLE_COPIES):
        table = torch.zeros(num_rows, width, dtype=torch.int32, device="cuda")
        table[:, width - live:] = _pages(num_rows, live, pool)
        tables.append(table)
    return cache, tables


def _entries(num_rows: int, num_entries: int, page: int, dim: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    width = -(-num_entries // page)
    pool = num_rows * width + 1
    cache = torch.randn(pool, page, dim, device="cuda", dtype=BF16)
    return cache, [_pages(num_rows, width, pool) for _ in range(TABLE_COPIES)]


def _row(op, ms, num_bytes, ceilings, **fields):
    copy_ms = num_bytes / ceilings["copy"] * 1e3
    return dict(op=op, ms=ms, us=ms * 1e3, bytes=num_bytes, gb_s=num_bytes / ms / 1e6,
                pct_copy=100 * copy_ms / ms, roofline_ms=copy_ms, copy_time_ratio=ms / copy_ms, **fields)


def _attention_setup(num_rows, context, kind):
    rate = CSA_RATE if kind == "csa" else HCA_RATE
    num_entries = context // rate
    window_cache, win_tables = _window_tables(num_rows, context)
    entry_cache, entry_tables = _entries(num_rows, num_entries, max(1, BLOCK_SIZE // rate), HEAD_DIM)
    q = torch.randn(num_rows, HEADS, HEAD_DIM, device="cuda", dtype=BF16)
    sinks = torch.randn(HEADS, device="cuda")
    key_lens = torch.full((num_rows,), context, dtype=torch.int32, device="cuda")
    indices = None
    if kind == "csa":
        scores = torch.rand(num_rows, num_entries, device="cuda")
        indices = scores.topk(TOP_K, dim=1).indices.sort(dim=1).values.to(torch.int32)
    keys = WINDOW + (TOP_K if kind == "csa" else num_entries)
    return dict(q=q, window_cache=window_cache, win_tables=win_tables, entry_cache=entry_cache,
                entry_tables=entry_tables, sinks=sinks, key_lens=key_lens, indices=indices, rate=rate, keys=keys)


def _fp8(cache: torch.Tensor) -> FP8LatentCache:
    """A bf16 key cache [nb, bs, D] as the FP8 cache a write would make of it."""
    return quantized_cache(cache, cache.shape[2] - 2 * ROPE_PAIRS)


def bench_fp8_attention(num_rows, context, kind, ceilings, bf16_ms):
    """`bench_attention`'s op as called, over FP8 copies of its caches (its kernel and splits: the
    warpgroup-MMA stage 1 where `wgmma_parts` takes it, widening the e4m3 tiles in shared memory)."""
    s = _attention_setup(num_rows, context, kind)
    s.update(window_cache=_fp8(s["window_cache"]), entry_cache=_fp8(s["entry_cache"]))
    max_keys = v4_attention.max_keys_of(WINDOW, s["entry_cache"], s["entry_tables"][0], s["indices"])
    workspace = v4_attention.v4_attention_workspace(num_rows, HEADS, HEAD_DIM, max_keys, "cuda")
    ms = common.time_graph([lambda i=i: _attend(s, i, workspace) for i in range(TABLE_COPIES)])
    queries_outputs = v4_attention.v4_attention_bytes(num_rows, HEADS, HEAD_DIM, 0, 2)
    num_bytes = num_rows * s["keys"] * FP8_KEY_BYTES + queries_outputs
    wgmma = v4_attention.wgmma_parts(num_rows, HEADS, HEAD_DIM, BF16, torch.device("cuda")) > 0
    splits = 1 if wgmma else v4_attention.v4_attention_num_splits(num_rows, HEADS, max_keys, "cuda")
    return _row(f"{kind}_attention_fp8", ms, num_bytes, ceilings, batch=num_rows, context=context, heads=HEADS,
                keys_per_row=s["keys"], splits=splits, kernel="wgmma" if wgmma else "tl.dot", cache="fp8",
                bf16_over_fp8=bf16_ms / ms,
                bytes_counted="FP8 window + entries read (592 bytes a key) + queries + outputs")


def _attend(s, i, workspace, indices=None, config=None, num_splits=None):
    return v4_attention.window_entry_attention(
        s["q"], s["window_cache"], s["win_tables"][i], s["key_lens"], s["sinks"], softmax_scale=HEAD_DIM ** -0.5,
        sliding_window=WINDOW, entry_cache=s["entry_cache"], entry_table=s["entry_tables"][i],
        entry_indices=s["indices"] if indices is None else indices, compress_rate=s["rate"], workspace=workspace,
        config=config, num_splits=num_splits)


def bench_attention(num_rows, context, kind, ceilings, config=None, num_splits=None, eager=True):
    """The op as a model calls it (its own kernel and split choice), or with `config` / `num_splits` (sweeps:
    the tl.dot kernel at those). Where the op takes the warpgroup-MMA stage 1, the returned rows hold the
    tl.dot twin at its own splits too (op `{kind}_attention_twin`), timed in the same run."""
    s = _attention_setup(num_rows, context, kind)
    max_keys = v4_attention.max_keys_of(WINDOW, s["entry_cache"], s["entry_tables"][0], s["indices"])
    splits = num_splits or v4_attention.v4_attention_num_splits(num_rows, HEADS, max_keys, "cuda", config)
    workspace = (torch.empty(num_rows, HEADS, splits, HEAD_DIM, device="cuda"),
                 torch.empty(num_rows, HEADS, splits, device="cuda"))
    num_bytes = v4_attention.v4_attention_bytes(num_rows, HEADS, HEAD_DIM, s["keys"], 2)
    wgmma = config is None and num_splits is None and \
        v4_attention.wgmma_parts(num_rows, HEADS, HEAD_DIM, BF16, torch.device("cuda")) > 0
    rows = []
    for twin in ((False, True) if wgmma else (False,)):
        as_called = wgmma and not twin
        call_splits = None if as_called else splits
        ms = common.time_graph([lambda i=i: _attend(s, i, workspace, config=config, num_splits=call_splits)
                                for i in range(TABLE_COPIES)])
        row = _row(f"{kind}_attention" + ("_twin" if twin else ""), ms, num_bytes, ceilings, batch=num_rows,
                   context=context, heads=HEADS, keys_per_row=s["keys"], splits=1 if as_called else splits,
                   kernel="wgmma" if as_called else "tl.dot",
                   bytes_counted="window + entries read + queries + outputs")
        if eager:
            row["eager_ms"] = common.time_eager(lambda: _attend(s, 0, workspace, num_splits=call_splits))
        rows.append(row)
    return rows


def bench_csa_decode(num_rows, context, ceilings, eager=True):
    """Indexer scores over the complete entries' keys, top-k, then the attention: one CSA layer."""
    s = _attention_setup(num_rows, context, "csa")
    num_entries = context // CSA_RATE
    index_cache, index_tables = _entries(num_rows, num_entries, BLOCK_SIZE // CSA_RATE, INDEX_DIM)
    index_q = torch.randn(num_rows, INDEX_HEADS, INDEX_DIM, device="cuda", dtype=BF16)
    head_weights = torch.randn(num_rows, INDEX_HEADS, device="cuda") * INDEX_HEADS ** -0.5
    counts = torch.full((num_rows,), num_entries, dtype=torch.int32, device="cuda")
    candidates = index_tables[0].shape[1] * index_cache.shape[1]
    scores = torch.empty(num_rows, candidates, device="cuda")
    indices = torch.empty(num_rows, TOP_K, dtype=torch.int32, device="cuda")
    topk_workspace = dsa_topk.top_k_workspace(num_rows, candidates, "cuda", k=TOP_K)
    max_keys = WINDOW + TOP_K
    workspace = v4_attention.v4_attention_workspace(num_rows, HEADS, HEAD_DIM, max_keys, "cuda")

    def call(i):
        dsa_indexer.index_scores(index_q, head_weights, index_cache, index_tables[i], counts, out=scores)
        dsa_topk.top_k_indices(scores, counts, k=TOP_K, out=indices, workspace=topk_workspace)
        return _attend(s, i, workspace, indices=indices)

    ms = common.time_graph([lambda i=i: call(i) for i in range(TABLE_COPIES)])
    key_bytes = num_rows * num_entries * INDEX_DIM * 2
    attention_bytes = v4_attention.v4_attention_bytes(num_rows, HEADS, HEAD_DIM, max_keys, 2)
    wgmma = v4_attention.wgmma_parts(num_rows, HEADS, HEAD_DIM, BF16, torch.device("cuda")) > 0
    row = _row("csa_decode", ms, key_bytes + attention_bytes, ceilings, batch=num_rows, context=context,
               heads=HEADS, keys_per_row=max_keys, index_key_bytes=key_bytes, attention_bytes=attention_bytes,
               kernel="wgmma" if wgmma else "tl.dot",
               bytes_counted="indexer keys + window + selected entries + queries + outputs")
    if eager:
        row["eager_ms"] = common.time_eager(lambda: call(0))
    return row


def bench_compress(num_rows, context, kind, ceilings, eager=True):
    """Every row completes an entry at the end of its context."""
    overlap = kind == "csa"
    rate = CSA_RATE if overlap else HCA_RATE
    c = 2 if overlap else 1
    width = -(-c * rate // BLOCK_SIZE) + 1
    pool = num_rows * width * TABLE_COPIES + 1
    inputs = torch.randn(pool, BLOCK_SIZE, 2 * c * HEAD_DIM, device="cuda", dtype=BF16)
    tables = []
    for _ in range(TABLE_COPIES):
        table = torch.zeros(num_rows, context // BLOCK_SIZE, dtype=torch.int32, device="cuda")
        table[:, -width:] = _pages(num_rows, width, pool)
        tables.append(table)
    entry_page = max(1, BLOCK_SIZE // rate)
    entries = torch.zeros(num_rows * (context // rate // entry_page) + 1, entry_page, HEAD_DIM, device="cuda",
                          dtype=BF16)
    slots = (torch.randperm((entries.shape[0] - 1) * entry_page, device="cuda")[:num_rows] + entry_page)
    key_lens = torch.full((num_rows,), context, dtype=torch.int32, device="cuda")
    bias = torch.randn(rate, c * HEAD_DIM, device="cuda")
    norm = torch.ones(HEAD_DIM, device="cuda", dtype=BF16)
    angles = torch.rand(context, ROPE_PAIRS, device="cuda")
    cos, sin = angles.cos(), angles.sin()

    def call(i):
        return v4_compress.compress_entries(inputs, entries, slots, key_lens, tables[i], bias, norm, cos, sin,
                                            rate=rate, overlap=overlap, eps=1e-6, num_seqs=num_rows, inplace=True)

    ms = common.time_graph([lambda i=i: call(i) for i in range(TABLE_COPIES)])
    num_bytes = num_rows * (c * rate * 2 * HEAD_DIM * 2 + HEAD_DIM * 2)
    row = _row(f"compress_{kind}", ms, num_bytes, ceilings, batch=num_rows, context=context, heads=HEADS,
               bytes_counted="the block's kv and gate inputs read + the entry written")
    if eager:
        row["eager_ms"] = common.time_eager(lambda: call(0))
    return row


def sweep(ceilings):
    """Tiles (heads a program, keys a step, warps, stages) x split counts at B=64, 64K, 64 heads; each
    row is printed when timed, so a sweep cut short still reports what it measured."""
    rows = []
    print("\n== sweep ==", flush=True)
    configs = [DecodeConfig(h, n, w, s) for h in (16, 32, 64) for n in (32, 64) for w in (4, 8) for s in (1, 2)]
    for cfg in configs:
        for splits in (1, 2, None):
            for kind in ("csa", "hca"):
                try:
                    r, = bench_attention(64, 64 * 1024, kind, ceilings, config=cfg, num_splits=splits,
                                         eager=False)
                except Exception as exc:  # a config that does not compile is a sweep result, not a failure
                    r = dict(op=f"{kind}_attention", error=repr(exc)[:120])
                common.sweep_row(rows, r, config=str(cfg), case=f"{kind} B64 ctx64K H64")
    return rows


def main(argv=None) -> None:
    args = common.kernel_bench_parser(__doc__).parse_args(argv)
    result, ceilings = common.kernel_bench_run(
        "bench/v4_kernels.py", args.commit,
        timing=common.GRAPH_REPLAY_TIMING,
        targets="V4 decode (csa_decode, hca_attention rows) at B >= 64: t/t_copy <= 1.3")
    if args.sweep:
        sweep(ceilings)
        return

    for context in CONTEXTS:
        for num_rows in BATCHES:
            for kind in ("hca", "csa"):
                rows = bench_attention(num_rows, context, kind, ceilings)
                result["rows"] += rows
                if context == CONTEXTS[-1] and num_rows in FP8_BATCHES:
                    result["rows"].append(bench_fp8_attention(num_rows, context, kind, ceilings, rows[0]["ms"]))
            result["rows"].append(bench_csa_decode(num_rows, context, ceilings))
            torch.cuda.empty_cache()
    for num_rows in BATCHES:
        for kind in ("csa", "hca"):
            result["rows"].append(bench_compress(num_rows, 64 * 1024, kind, ceilings))
    path = common.write_json(result, args.out, "v4-kernels")
    rows = [dict(c, shape=f"B{c['batch']} ctx{c['context'] // 1024}K H{c['heads']}") for c in result["rows"]]
    print(f"\n{result['gpu']}  commit {result['commit'][:12]}  copy {result['copy_bandwidth_gb_s']:.0f} GB/s  "
          f"-> {path}")
    common.print_table(rows, [("op", "op"), ("shape", "shape"), ("kernel", "kernel"), ("keys_per_row", "keys/row"),
                              ("splits", "splits"),
                              ("us", "us"), ("eager_ms", "eager ms"), ("roofline_ms", "roofline ms"),
                              ("gb_s", "GB/s"), ("pct_copy", "%copy"), ("copy_time_ratio", "t/t_copy"),
                              ("bf16_over_fp8", "bf16/fp8")])


if __name__ == "__main__":
    main()
