"""The radix select of `dsa_topk` in one launch: a row's chunk programs wait for each other.

`dsa_topk` runs a pass per launch (four histogram launches and the emit), so that a
pass's programs find every chunk histogram of the pass before already written. Few
long rows (decode at batch 8 and 128K context: 8 rows of 33 chunks of one 4K tile)
spend those launches mostly starting, draining and folding: H200, v32-lite, 6.5-11 us
each, 41 us a layer for no bytes (bench/results/dsa-kernels/h200/logs-archive/
profile-v32-lite-b8-128k-66b9686-h200-2026-11-24.log). Here every program carries its row's state in registers from
pass to pass. It adds its chunk histogram of a pass into the row's histogram (an
atomic a bin; a tile of few bucket keys adds them one by one), then reads the row's
histogram until its bins add up to the bucket's size, which the previous pass told
every program: a grid barrier per row that is also the histogram's read. Every
program then takes the same digit, so a row's programs agree on whether to take the
next pass. After the last pass each chunk counts its keys above the final bucket and
in it, and the chunks trade those counts the same way (the row's totals are known),
which gives each its first output slot; then they emit. A chunk of one tile keeps
its keys in registers from the first pass to the emit.

Waiting on other programs needs all of a row's programs resident at once: the kernel
is launched as a cooperative grid (the driver refuses a grid that cannot be resident,
rather than letting it hang), with its registers capped so that the grid's size is
known to fit (`synced_max_chunks`). The workspace is zeroed by a small launch first: a
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
from .topk_radix import (add_tile_histogram, choose_digit, chunk_start, count_bucket, emit_chunk, emit_keys,
                         initial_state, narrow_bucket)
from .topk_shared import fill_unselected, load_keys, visible_keys

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


# The synced path's workspace [T, passes + 1, 1, BINS]: pass p's row histogram in plane p,
# then in the last plane each chunk c's final counts of keys above the bucket (slot c) and
# in it (slot BLOCK_P + c). All of it is zeroed first: a program waits until the values it
# reads add up to a total it knows in advance, and counts only grow.


@triton.jit
def _clear_kernel(ws_ptr, s_wt, s_wp, PLANES: tl.constexpr, BINS: tl.constexpr, GDC: tl.constexpr):
    """Zeroes row t's workspace (program t)."""
    t = tl.program_id(0)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    bins = tl.arange(0, BINS)
    for p in tl.static_range(PLANES):
        tl.store(ws_row + p * s_wp + bins, tl.zeros([BINS], dtype=tl.int32))


@triton.jit
def _wait_for_total(ptr, offs, mask, total):
    """Reads the counts at ptr + offs (masked lanes 0) until they add up to total, and returns them.

    Other programs of the row add into these zeroed counts; a count only grows, so the sum
    reaching the total they will have means every program's part has landed. Volatile loads
    read L2 afresh on every round (a line cached by this multiprocessor would be stale).
    """
    counts = tl.load(ptr + offs, mask=mask, other=0, volatile=True)
    while tl.sum(counts, axis=0) < total:
        counts = tl.load(ptr + offs, mask=mask, other=0, volatile=True)
    return counts


@triton.jit
def _synced_kernel(
    scores_ptr, key_lens_ptr, ws_ptr, out_ptr,
    num_cols, chunk_len, num_chunks,
    s_st, s_sj, s_kl, s_wt, s_wp, s_ot, s_ok,
    K: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    BINS: tl.constexpr, RADIX_BITS: tl.constexpr, FILL_BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
    RESIDENT: tl.constexpr, FIRST_SPARSE_PASS: tl.constexpr, SPARSE_SHARE: tl.constexpr, GDC: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    if GDC:
        gdc_wait()
    n = visible_keys(key_lens_ptr, t, s_kl, num_cols)
    ws_row = ws_ptr + t.to(tl.int64) * s_wt
    row = scores_ptr + t.to(tl.int64) * s_st
    start = tl.multiple_of(chunk * chunk_len, BLOCK)
    end = tl.minimum(start + chunk_len, n)
    bins = tl.arange(0, BINS)
    offs = tl.arange(0, BLOCK)
    if RESIDENT:
        # A chunk of one tile stays in registers from the first pass to the emit.
        resident = load_keys(row, start + offs, end, s_sj, ALIGNED)
    # The row's state before any pass; the per-chunk counts of a row that never refines
    # follow from n alone.
    prefix, hi_mask, want, refining, above, ties = initial_state(n, K, chunk_len, BLOCK_P)
    bucket = n
    for p in tl.static_range(PASSES):
        if refining:
            row_hist = ws_row + p * s_wp
            sparse = p >= FIRST_SPARSE_PASS
            # Sparse tiles add their members straight into the row's histogram; the dense
            # ones' counts are added once, a bin an atomic.
            hist = tl.zeros([BINS], dtype=tl.int32)
            if RESIDENT:
                hist = add_tile_histogram(resident, start + offs < end, prefix, hi_mask, hist, row_hist, p, BLOCK,
                                          BINS, RADIX_BITS, sparse, SPARSE_SHARE)
            else:
                for j0 in range(start, end, BLOCK):
                    pos = j0 + offs
                    hist = add_tile_histogram(load_keys(row, pos, end, s_sj, ALIGNED), pos < end, prefix, hi_mask,
                                              hist, row_hist, p, BLOCK, BINS, RADIX_BITS, sparse, SPARSE_SHARE)
            tl.atomic_add(row_hist + bins, hist, sem="relaxed")
            # The row's histogram counts every key of the bucket once it is complete.
            total = _wait_for_total(row_hist, bins, bins < BINS, bucket)
            chosen, bucket, want = choose_digit(total, want, BINS)
            prefix, hi_mask = narrow_bucket(prefix, hi_mask, chosen, p, RADIX_BITS)
            refining = bucket > want
    if n > K:
        # Each chunk's first output slot needs the counts of the chunks before it: the row
        # has min(n, K) - want keys above the bucket and `bucket` in it.
        if RESIDENT:
            own_above, own_ties = count_bucket(resident, start + offs < end, prefix, hi_mask)
        else:
            own_above = tl.zeros([], dtype=tl.int32)
            own_ties = tl.zeros([], dtype=tl.int32)
            for j0 in range(start, end, BLOCK):
                pos = j0 + offs
                tile_above, tile_ties = count_bucket(load_keys(row, pos, end, s_sj, ALIGNED), pos < end, prefix,
                                                     hi_mask)
                own_above += tile_above
                own_ties += tile_ties
        exchange = ws_row + PASSES * s_wp
        kinds = tl.arange(0, 2)
        tl.store(exchange + kinds * BLOCK_P + chunk, tl.where(kinds == 0, own_above, own_ties))
        slots = tl.arange(0, 2 * BLOCK_P)
        counts = _wait_for_total(exchange, slots, slots % BLOCK_P < num_chunks, tl.minimum(n, K) - want + bucket)
        counts = tl.reshape(counts, [2, BLOCK_P])
        above = tl.sum(tl.where(kinds[:, None] == 0, counts, 0), axis=0)
        ties = tl.sum(tl.where(kinds[:, None] == 1, counts, 0), axis=0)
    if GDC:
        gdc_launch_dependents()
    out_row = out_ptr + t.to(tl.int64) * s_ot
    if RESIDENT:
        above_seen, ties_seen = chunk_start(above, ties, chunk, BLOCK_P)
        emit_keys(out_row, s_ok, start + offs, resident, start + offs < end, prefix, hi_mask, want,
                  above_seen, ties_seen, K)
        if chunk == 0:
            fill_unselected(out_row, s_ok, tl.minimum(n, K), K, FILL_BLOCK)
    else:
        emit_chunk(row, s_sj, out_row, s_ok, n, chunk, chunk_len, prefix, hi_mask, want, above, ties, K, BLOCK,
                   BLOCK_P, FILL_BLOCK, ALIGNED)


def synced_top_k(scores: torch.Tensor, key_lens: torch.Tensor, k: int, out: torch.Tensor, workspace: torch.Tensor,
                 num_chunks: int, chunk_len: int, *, block: int, num_warps: int, max_registers: int,
                 passes: int, bins: int,
                 radix_bits: int, fill_block: int, first_sparse_pass: int, sparse_share: int,
                 use_pdl: bool) -> torch.Tensor:
    """`dsa_topk.top_k_indices` in one launch (after the workspace's clearing), arguments checked by it.

    scores [T, L] float32, key_lens [T] int32, out [T, k] int32, workspace [T, passes + 1, 1,
    bins] int32 with unit stride along its bins; num_chunks at most
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
        workspace, workspace.stride(0), workspace.stride(1),
        PLANES=passes + 1, BINS=bins, GDC=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )
    _synced_kernel[(num_rows, num_chunks)](
        scores, key_lens, workspace, out,
        num_cols, chunk_len, num_chunks,
        *scores.stride(), key_lens.stride(0), workspace.stride(0), workspace.stride(1), *out.stride(),
        K=k, PASSES=passes, BLOCK=block, BLOCK_P=max(2, next_pow2(num_chunks)), BINS=bins, RADIX_BITS=radix_bits,
        FILL_BLOCK=fill_block, ALIGNED=aligned, RESIDENT=chunk_len == block, FIRST_SPARSE_PASS=first_sparse_pass,
        SPARSE_SHARE=sparse_share, GDC=use_pdl, num_warps=num_warps, launch_pdl=use_pdl,
        **(dict(maxnreg=max_registers, launch_cooperative_grid=True) if on_gpu else {}),
    )
    return out
