"""The radix select of `dsa_topk` in one launch: a row's chunk programs wait for each other.

`dsa_topk` runs a pass per launch (four histogram launches and the emit), so that a
pass's programs find every chunk histogram of the pass before already written. Few
long rows (decode at batch 8 and 128K context: 8 rows of 33 chunks of one 4K tile)
spend those launches mostly starting, draining and folding: H200, v32-lite, 6.5-11 us
each, 41 us a layer for no bytes (bench/results/logs/profile-v32-lite-b8-128k-66b9686-
h200-2026-11-24.log). Here every program carries its row's state in registers from
pass to pass. It adds its chunk histogram of a pass into the row's histogram (an
atomic a bin), then adds one to the row's arrival counter and waits until every chunk
of the row has: a grid barrier per row. Every program then reads the same row
histogram and takes the same digit, so a row's programs agree on whether to take the
next pass and on how many arrivals end it; each keeps only its own chunk's counts of
keys above the bucket and in it. After the last pass the chunks trade those counts
(one barrier more), which gives each its first output slot, and emit.

Waiting on other programs needs all of a row's programs resident at once: the kernel
is launched as a cooperative grid (the driver refuses a grid that cannot be resident,
rather than letting it hang), with its registers capped so that the grid's size is
known to fit (`synced_max_chunks`). The counters are zeroed by a small launch first: a
workspace from a graph's memory pool holds whatever its last user left there.
Triton's interpreter runs programs one after another, so on the CPU a row is one chunk.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2
from .topk_radix import choose_digit, chunk_histogram, emit_chunk, initial_state, narrow_bucket

# 32-bit registers of an NVIDIA multiprocessor (every one since Kepler, Hopper's too).
_REGISTERS_PER_SM = 65536


@functools.cache
def _programs_per_sm(index: int, num_warps: int, max_registers: int) -> int:
    threads = 32 * num_warps
    return max(0, min(torch.cuda.get_device_properties(index).max_threads_per_multi_processor // threads,
                      _REGISTERS_PER_SM // (max_registers * threads)))


def synced_max_chunks(num_rows: int, device: torch.device, num_warps: int, max_registers: int) -> int:
    """The most chunks a row of `synced_top_k` may have with num_rows rows (0: the rows alone do not fit).

    On an NVIDIA GPU, the programs of num_warps warps, max_registers registers a thread,
    resident at once over the rows; in the interpreter, one; on ROCm none (the register cap
    and the cooperative launch are NVIDIA's).
    """
    if device.type != "cuda":
        return 1
    if torch.version.hip is not None:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    resident = (torch.cuda.get_device_properties(index).multi_processor_count
                * _programs_per_sm(index, num_warps, max_registers))
    return resident // max(1, num_rows)


# The synced path's workspace [T, passes + 1, P + 1, BINS]: pass p's chunk histograms in
# ws[t, p, c] as on the passes path, and the row's histogram (their sum) in the extra row
# ws[t, p, P]; then in the extra plane, chunk c's final counts of keys above the bucket and
# in it at ws[t, passes, c, 0:2], and the row's arrival counter at ws[t, passes, P, 0].


@triton.jit
def _clear_kernel(ws_ptr, num_rows, num_chunks, s_wt, s_wp, s_wc,
                  PASSES: tl.constexpr, BINS: tl.constexpr, GDC: tl.constexpr):
    """Zeroes row t's pass histograms and arrival counter (program t)."""
    t = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    bins = tl.arange(0, BINS)
    for p in tl.static_range(PASSES):
        tl.store(ws_row + p * s_wp + num_chunks * s_wc + bins, tl.zeros([BINS], dtype=tl.int32))
    tl.store(ws_row + PASSES * s_wp + num_chunks * s_wc, 0)


@triton.jit
def _arrive_and_wait(counter, target):
    """Adds this program's arrival to the row's counter, then waits until it reaches target."""
    # Every thread's stores and atomics come before the one thread's release.
    tl.debug_barrier()
    seen = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _synced_kernel(
    scores_ptr, key_lens_ptr, ws_ptr, out_ptr,
    num_cols, chunk_len, num_chunks,
    s_st, s_sj, s_kl, s_wt, s_wp, s_wc, s_ot, s_ok,
    K: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    BINS: tl.constexpr, RADIX_BITS: tl.constexpr, FILL_BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
    FIRST_SPARSE_PASS: tl.constexpr, SPARSE_SHARE: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    if GDC:
        gdc_wait()
    n = tl.minimum(tl.maximum(tl.load(key_lens_ptr + t * s_kl), 0), num_cols)
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    counter = ws_row + PASSES * s_wp + num_chunks * s_wc
    row = scores_ptr + t.to(tl.int64) * s_st
    start = tl.multiple_of(chunk * chunk_len, BLOCK)
    end = tl.minimum(start + chunk_len, n)
    bins = tl.arange(0, BINS)
    # The row's state before any pass; the per-chunk counts of a row that never refines
    # follow from n alone.
    prefix, hi_mask, want, refining, above, ties = initial_state(n, K, chunk_len, BLOCK_P)
    own_above = tl.zeros([], dtype=tl.int32)
    own_ties = tl.zeros([], dtype=tl.int32)
    arrivals = tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(PASSES):
        if refining:
            slot = ws_row + p * s_wp + chunk * s_wc
            chunk_histogram(row, s_sj, start, end, prefix, hi_mask, slot, p, BLOCK, BINS, RADIX_BITS, ALIGNED,
                            p >= FIRST_SPARSE_PASS, SPARSE_SHARE)
            tl.debug_barrier()
            own = tl.load(slot + bins, cache_modifier=".cg")
            # The row's histogram is the sum of its chunks': one atomic a bin, where every
            # program reading every chunk's row cost ~3 us a pass at 33 chunks.
            tl.atomic_add(ws_row + p * s_wp + num_chunks * s_wc + bins, own, sem="relaxed")
            arrivals += 1
            _arrive_and_wait(counter, arrivals * num_chunks)
            total = tl.load(ws_row + p * s_wp + num_chunks * s_wc + bins, cache_modifier=".cg")
            chosen, in_bin, want = choose_digit(total, want, BINS)
            own_above += tl.sum(tl.where(bins > chosen, own, 0), axis=0)
            own_ties = tl.sum(tl.where(bins == chosen, own, 0), axis=0)
            prefix, hi_mask = narrow_bucket(prefix, hi_mask, chosen, p, RADIX_BITS)
            refining = in_bin > want
    if arrivals > 0:
        # Each chunk's first output slot needs the counts of the chunks before it.
        exchange = ws_row + PASSES * s_wp + tl.arange(0, BLOCK_P) * s_wc
        tl.store(ws_row + PASSES * s_wp + chunk * s_wc + tl.arange(0, 2),
                 tl.where(tl.arange(0, 2) == 0, own_above, own_ties))
        _arrive_and_wait(counter, (arrivals + 1) * num_chunks)
        chunk_mask = tl.arange(0, BLOCK_P) < num_chunks
        above = tl.load(exchange, mask=chunk_mask, other=0, cache_modifier=".cg")
        ties = tl.load(exchange + 1, mask=chunk_mask, other=0, cache_modifier=".cg")
    if GDC:
        gdc_launch_dependents()
    emit_chunk(row, s_sj, out_ptr + t.to(tl.int64) * s_ot, s_ok, n, chunk, chunk_len,
               prefix, hi_mask, want, above, ties, K, BLOCK, BLOCK_P, FILL_BLOCK, ALIGNED)


def synced_top_k(scores: torch.Tensor, key_lens: torch.Tensor, k: int, out: torch.Tensor, workspace: torch.Tensor,
                 num_chunks: int, chunk_len: int, *, block: int, num_warps: int, max_registers: int,
                 passes: int, bins: int,
                 radix_bits: int, fill_block: int, first_sparse_pass: int, sparse_share: int,
                 use_pdl: bool) -> torch.Tensor:
    """`dsa_topk.top_k_indices` in one launch (after the counters' clearing), arguments checked by it.

    scores [T, L] float32, key_lens [T] int32, out [T, k] int32, workspace [T, passes + 1,
    num_chunks + 1, bins] int32 with unit stride along its bins; num_chunks at most
    `synced_max_chunks(T, device, num_warps, max_registers)`.
    """
    num_rows, num_cols = scores.shape
    most = synced_max_chunks(num_rows, scores.device, num_warps, max_registers)
    if num_chunks > most:
        raise ValueError(f"num_chunks: {num_rows} rows of {num_chunks} chunks waiting for each other need them "
                         f"all resident at once; on {scores.device} at {num_warps} warps a row may have {most}")
    aligned = num_cols % 4 == 0 and scores.stride(1) == 1 and scores.stride(0) % 4 == 0
    on_gpu = scores.device.type == "cuda"
    _clear_kernel[(num_rows,)](
        workspace, num_rows, num_chunks, *workspace.stride()[:3],
        PASSES=passes, BINS=bins, GDC=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )
    _synced_kernel[(num_rows, num_chunks)](
        scores, key_lens, workspace, out,
        num_cols, chunk_len, num_chunks,
        *scores.stride(), key_lens.stride(0), *workspace.stride()[:3], *out.stride(),
        K=k, PASSES=passes, BLOCK=block, BLOCK_P=max(2, next_pow2(num_chunks)), BINS=bins, RADIX_BITS=radix_bits,
        FILL_BLOCK=fill_block, ALIGNED=aligned, FIRST_SPARSE_PASS=first_sparse_pass, SPARSE_SHARE=sparse_share,
        GDC=use_pdl, num_warps=num_warps, launch_pdl=use_pdl,
        **(dict(maxnreg=max_registers, launch_cooperative_grid=True) if on_gpu else {}),
    )
    return out
