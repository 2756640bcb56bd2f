"""One typed contract per op: what every backend's implementation of it must accept and return.

Each contract is a `Protocol` whose `__call__` is the op's signature and whose
docstring is the op's shape contract; `registry.Ops` fields are typed by them,
so a table that binds a function of another signature fails type checking.
Positional arguments are positional-only here, so implementations may name them
freely; keyword arguments are part of the contract by name.

Shapes use: T rows (tokens), B sequences, H heads, W block-table width, bs
block size, C = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim,
Dv = v_head_dim, E experts, k experts a token (in the DSA ops: k selected keys a row),
Hi indexer heads, Di = index_head_dim.

A `Weight` (`quantized`) is a tensor or a block-scaled FP8 pair: every backend computes with the
pair as with its dequantized tensor (`BlockFP8Weight.dequantize` into the activations' dtype, or
`out_dtype` where given), up to the rounding of its own products. The MLA ops' up-projections
(`w_uk` [H, Dn, C], `w_uv` [H, Dv, C]) are such weights stacked over heads.

A `LatentCache` (`latent_cache`) is the MLA latent cache [num_blocks, bs, C + R] as a tensor or as an
`FP8LatentCache` (FP8 values with per-group scales, RoPE values in the activations' dtype): the ops
that write it store rows as `reference.cache.write_kv` quantizes them, bit for bit, and the ops that
read it attend over its dequantized rows (`FP8LatentCache.rows`), up to the rounding of their own
products; an op returns the cache type it was given.
"""

from __future__ import annotations

from typing import Protocol, overload

import torch

from .held_experts import HeldExperts
from .index_cache import FP8IndexCache, IndexCache
from .latent_cache import FP8LatentCache, LatentCache
from .quantized import Weight

Tensor = torch.Tensor


class Linear(Protocol):
    def __call__(self, x: Tensor, weight: Weight, /, *, out_dtype: torch.dtype | None = None) -> Tensor:
        """x [T, K], weight [N, K] (a tensor or an FP8 pair) -> y = x @ weight^T [T, N] in x's dtype,
        or computed from both inputs widened to `out_dtype` when that is given."""
        ...


class Logits(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, /) -> Tensor:
        """The LM head: x [N, D] @ weight [V, D]^T as `Linear` computes and rounds it (in x's dtype),
        returned widened to at least float32 -> [N, V]."""
        ...


class RmsNorm(Protocol):
    @overload
    def __call__(self, x: Tensor, weight: Tensor, eps: float, /, residual: None = None) -> Tensor: ...
    @overload
    def __call__(self, x: Tensor, weight: Tensor, eps: float, /, residual: Tensor) -> tuple[Tensor, Tensor]: ...

    def __call__(self, x: Tensor, weight: Tensor, eps: float, /, residual: Tensor | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        """x, residual [T, D]; weight [D] -> y = weight * x / sqrt(mean(x^2) + eps) [T, D]
        (statistics in at least float32); with `residual`, (y, x + residual) where y
        normalises the sum, rounded to residual's dtype."""
        ...


class LayerNorm(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor, eps: float, /) -> Tensor:
        """x [T, D] (any strides); weight, bias [D] -> y = (x - mean(x)) / sqrt(var(x) + eps) * weight
        + bias [T, D] in promote(x, weight) dtype, statistics and the affine map in at least float32
        (`torch.nn.functional.layer_norm`'s rounding: once, at the end)."""
        ...


class RmsNormLinear(Protocol):
    @overload
    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /, residual: None = None
                 ) -> Tensor: ...
    @overload
    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /, residual: Tensor
                 ) -> tuple[Tensor, Tensor]: ...

    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Weight, /,
                 residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """linear(rms_norm(x [+ residual]), weight): x, residual [T, K]; norm_weight [K];
        weight [N, K] (a tensor or an FP8 pair) -> y [T, N]; with `residual`, (y, x + residual) as `RmsNorm`."""
        ...


class Rope(Protocol):
    def __call__(self, q_pe: Tensor, k_pe: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, /, *,
                 interleaved: bool) -> tuple[Tensor, Tensor]:
        """Rotate q_pe [T, H, R] and k_pe [T, R] by the angles at positions [T]; cos, sin
        [max_positions, R / 2]. `interleaved` inputs pair (x0, x1), (x2, x3), ...; the
        output is always half-split (same permutation for both, dot products unchanged)."""
        ...


class PartialRope(Protocol):
    def __call__(self, q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, /, *, rotary_dim: int,
                 interleaved: bool) -> tuple[Tensor, Tensor]:
        """`Rope` of the first rotary_dim dims of q [T, H, D] and k [T, D], the other dims passed
        through -> new (q [T, H, D], k [T, D]); cos, sin [max_positions, rotary_dim / 2]."""
        ...


class MergeAttnStates(Protocol):
    def __call__(self, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, /) -> tuple[Tensor, Tensor]:
        """Two partial attention results over disjoint key sets: out [T, H, D], lse [T, H]
        float32 natural-log sums (-inf = empty) -> out [T, H, D] in out_a's dtype, lse [T, H]
        float32. Both sides empty gives out 0 and lse -inf, never NaN."""
        ...


class WriteKv(Protocol):
    @overload
    def __call__(self, kv_cache: Tensor, slot_mapping: Tensor, kv: Tensor, /, *, inplace: bool = True) -> Tensor: ...
    @overload
    def __call__(self, kv_cache: FP8LatentCache, slot_mapping: Tensor, kv: Tensor, /, *,
                 inplace: bool = True) -> FP8LatentCache: ...

    def __call__(self, kv_cache: LatentCache, slot_mapping: Tensor, kv: Tensor, /, *,
                 inplace: bool = True) -> LatentCache:
        """kv_cache [num_blocks, bs, D] (a tensor, or an `FP8LatentCache` with D = C + R, which
        takes the rows quantized); slot_mapping [T] (block * bs + offset, -1 = padding, which
        writes at most the scratch block); kv [T, D] -> the cache with the rows written: the same
        value when `inplace`, else a new one (the input left untouched)."""
        ...


class WriteLatent(Protocol):
    def __call__(self, kv_cache: LatentCache, slot_mapping: Tensor, latent: Tensor, kv_a_norm: Tensor,
                 q_pe: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, /, *, eps: float, interleaved: bool,
                 inplace: bool = True) -> tuple[LatentCache, Tensor]:
        """`RmsNorm`, `Rope` and `WriteKv` of one step's latents as one op. kv_cache
        [num_blocks, bs, C + R]; slot_mapping [T]; latent [T, C + R] (c_kv, then k_pe before
        rotation); kv_a_norm [C]; q_pe [T, H, R] before rotation; positions [T]; cos, sin as
        `Rope` -> (the cache with [rms_norm(c_kv), rope(k_pe)] written, rotated q_pe [T, H, R])."""
        ...


class WriteLatentAbsorb(Protocol):
    def __call__(self, kv_cache: LatentCache, slot_mapping: Tensor, latent: Tensor, kv_a_norm: Tensor,
                 q_nope: Tensor, q_pe: Tensor, w_uk: Weight, positions: Tensor, cos: Tensor, sin: Tensor, /, *,
                 eps: float, interleaved: bool, absorb_from: int,
                 inplace: bool = True) -> tuple[LatentCache, Tensor, Tensor]:
        """`WriteLatent`, then `AbsorbQuery` of the rows from absorb_from in [0, T] on.
        q_nope [T, H, Dn]; w_uk [H, Dn, C] -> (kv_cache, rotated q_pe [T, H, R],
        absorbed q [T - absorb_from, H, C + R])."""
        ...


class AbsorbQuery(Protocol):
    def __call__(self, q_nope: Tensor, q_pe: Tensor, w_uk: Weight, /) -> Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, R], w_uk [H, Dn, C] -> q [T, H, C + R]: each head's
        q_nope through its key up-projection, then q_pe (what `MlaDecode` scores the cache with)."""
        ...


class MlaDecode(Protocol):
    def __call__(self, q: Tensor, kv_cache: LatentCache, block_table: Tensor, seq_lens: Tensor, /, *,
                 softmax_scale: float, kv_lora_rank: int, w_uv: Weight | None = None,
                 q_len: int = 1) -> tuple[Tensor, Tensor]:
        """Absorbed MLA decode of q_len causal query tokens per sequence over the latent cache,
        which already holds the step's keys. q [B * q_len, H, C + R] (rows of sequence b are
        b * q_len ..., in position order); kv_cache [num_blocks, bs, C + R]; block_table [B, W]
        int32; seq_lens [B] int32 KV length after the step (0 = padded sequence); query j sees
        keys [0, seq_lens[b] - q_len + j]; w_uv [H, Dv, C] or None -> out [B * q_len, H, C]
        (with w_uv [B * q_len, H, Dv]) in q's dtype, lse [B * q_len, H] float32; a padded
        sequence's rows give out 0, lse -inf."""
        ...


class PrefillAttention(Protocol):
    def __call__(self, q_nope: Tensor, q_pe: Tensor, kv_cache: LatentCache, block_table: Tensor, cu_seqlens_q: Tensor,
                 seq_lens: Tensor, positions: Tensor, w_uk: Weight, w_uv: Weight, /, *,
                 softmax_scale: float) -> tuple[Tensor, Tensor]:
        """MLA prefill: new tokens attend causally over their own sequence's cache, which
        already holds their keys. q_nope [T, H, Dn]; q_pe [T, H, R] rotated; block_table
        [B, W] int32; cu_seqlens_q [B + 1] int32 (rows from cu[B] on are padding); seq_lens
        [B] int32; positions [T] (token t sees keys j <= positions[t]); w_uk [H, Dn, C];
        w_uv [H, Dv, C] -> out [T, H, Dv] in q's dtype, lse [T, H] float32; padded rows 0 / -inf."""
        ...


class Route(Protocol):
    def __call__(self, x: Tensor, gate: Tensor, e_score_correction_bias: Tensor | None, valid: Tensor, /, *,
                 top_k: int, scoring_func: str, topk_method: str, n_group: int | None, topk_group: int | None,
                 norm_topk_prob: bool, routed_scaling_factor: float, num_shared: int = 0,
                 fixed_ids: Tensor | None = None, held: HeldExperts | None = None) -> tuple[Tensor, Tensor]:
        """Each token's top_k experts, then num_shared shared experts E .. E + S - 1 of weight 1.
        x [T, D]; gate [E, D] float32; e_score_correction_bias [E] or None (steers the choice
        only); valid [T] bool; fixed_ids [T, k] or None: experts chosen beforehand (hash
        routing), weighted by their scores as a choice would be; held: an expert-parallel rank's
        experts (`held_experts`: chosen ids renumbered among those it holds, -1 and weight 0 for
        the others, shared ids from its count, on its share of the rows), or None for all ->
        topk_weights [T, k + S] float32, topk_ids [T, k + S] int64; padded rows get id -1 and
        weight 0. Methods and scoring: `checks.TOPK_METHODS`, `checks.SCORING_FUNCS`."""
        ...


class FusedMoe(Protocol):
    def __call__(self, x: Tensor, w13: Weight, w2: Weight, topk_weights: Tensor, topk_ids: Tensor, /, *,
                 out_dtype: torch.dtype | None = None) -> Tensor:
        """Sum over each token's chosen experts of weight * down(silu(gate(x)) * up(x)).
        x [T, D]; w13 [E, 2I, D] (gate rows, then up); w2 [E, D, I] (tensors or stacked FP8 pairs); topk_weights [T, k]
        float32; topk_ids [T, k] (-1 takes no expert) -> [T, D] in out_dtype (x's by default)."""
        ...


class WriteIndexKey(Protocol):
    def __call__(self, index_cache: IndexCache, slot_mapping: Tensor, index_key: Tensor, /, *,
                 inplace: bool) -> IndexCache:
        """DSA indexer keys into their paged cache, addressed like the latent cache.
        index_cache [num_blocks, bs, Di] (a tensor, or an `FP8IndexCache`, which takes each key quantized as
        `reference.dsa.quantize_index_keys` does, bit for bit); slot_mapping [T] int64 (-1: skip the row);
        index_key [T, Di] -> the cache with the rows written, of the type given: the same value when
        `inplace`, else a new one."""
        ...


class IndexScores(Protocol):
    def __call__(self, q: Tensor, head_weights: Tensor, index_cache: IndexCache, block_table: Tensor,
                 key_lens: Tensor, /, *, weight_scale: float = 1.0) -> Tensor:
        """The lightning indexer's score of every key position of each row's sequence.
        q [T, Hi, Di]; head_weights [T, Hi] float32; index_cache [num_blocks, bs, Di] (an `FP8IndexCache`
        read dequantized, value * scale in float32);
        block_table [T, W] int32 (row t's sequence's); key_lens [T] int32; weight_scale the
        score's constant factor -> scores [T, W * bs] float32: sum_h w[t, h] * relu(q[t, h] .
        key_j) (dot in float32), w = head_weights * weight_scale rounded as that product is in
        head_weights' dtype, for j < key_lens[t]; -inf for j >= key_lens[t] (padded rows:
        key_lens 0)."""
        ...


class TopKIndices(Protocol):
    def __call__(self, scores: Tensor, key_lens: Tensor, /, *, k: int) -> Tensor:
        """scores [T, L] float32; key_lens [T] int32 -> indices [T, k] int32: the positions of the k
        largest scores among j < key_lens[t], ties broken toward the lower position, listed in
        ascending position order; -1 fills the tail when key_lens[t] < k (every visible position
        is then listed, in order)."""
        ...


class SparseMlaDecode(Protocol):
    def __call__(self, q: Tensor, kv_cache: LatentCache, block_table: Tensor, indices: Tensor, /, *,
                 softmax_scale: float, kv_lora_rank: int, w_uv: Weight | None = None) -> tuple[Tensor, Tensor]:
        """Absorbed MLA of each row over its selected latent rows only (prefill and decode rows alike).
        q [T, H, C + R] absorbed query; kv_cache [num_blocks, bs, C + R]; block_table [T, W] int32;
        indices [T, k] int32 key positions in row t's sequence (-1 = none); w_uv [H, Dv, C] or None
        -> out [T, H, C] in q's dtype (with w_uv: out rounded to q's dtype, then @ w_uv[h]^T,
        [T, H, Dv]), lse [T, H] float32 natural log; a row with no valid index: out 0, lse -inf."""
        ...


# ---- DeepSeek-V4 (`reference.v4_attention`, `reference.v4_moe`) ----------------------------


class RopeTail(Protocol):
    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, /, *, positions: Tensor | None = None,
                 unit_rms_eps: float | None = None, inverse: bool = False) -> Tensor:
        """Rotate the trailing R channels of x [..., D] by interleaved pairs; cos, sin [..., R / 2]
        broadcastable to x's leading dims, or with positions [T] (x [T, ..., D]) tables [P, R / 2] whose
        row positions[t] rotates token t; with unit_rms_eps, x is `UnitRms`'d first (the rows as
        rounded to x's dtype are rotated); `inverse` rotates by the opposite angle -> [..., D]."""
        ...


class UnitRms(Protocol):
    def __call__(self, x: Tensor, eps: float, /) -> Tensor:
        """x / sqrt(mean(x^2) + eps) over the last dim (no weight), statistics in at least float32."""
        ...


class WindowEntryAttention(Protocol):
    def __call__(self, q: Tensor, window_cache: LatentCache, block_table: Tensor, key_lens: Tensor, sinks: Tensor,
                 /, *, softmax_scale: float, sliding_window: int, entry_cache: LatentCache | None = None,
                 entry_table: Tensor | None = None, entry_indices: Tensor | None = None,
                 compress_rate: int = 0) -> tuple[Tensor, Tensor]:
        """Each row over its window and its compressed entries (values = keys), with a per-head sink:
        q [n, H, D]; window_cache [nb, bs, D] through block_table [n, W] int32, positions
        [key_lens - sliding_window, key_lens) >= 0 (key_lens [n] int32: position + 1, 0 padded);
        sinks [H]; entry_cache [nbg, bsg, D] through entry_table [n, Wg] int32 (None: no entries),
        the entries entry_indices [n, k] int32 lists (-1: none) or, without it, all, each only if
        e < key_lens // compress_rate -> out [n, H, D] in q's dtype, lse [n, H] float32 of the scopes
        and the sink; empty scopes add nothing, a padded row gets out 0, never NaN. Either cache may be
        an `FP8LatentCache` (D = C + R, both of one type), read as its dequantized rows."""
        ...


class CompressEntries(Protocol):
    # One overload a cache type (the implementations take a type variable): a call with a union of them,
    # as a layer's cache fields are typed, returns the same union.
    @overload
    def __call__(self, inputs: Tensor, entries: Tensor, group_slots: Tensor, key_lens: Tensor, block_table: Tensor,
                 position_bias: Tensor, kv_norm: Tensor, cos: Tensor, sin: Tensor, /, *, rate: int, overlap: bool,
                 eps: float, num_seqs: int, inplace: bool) -> Tensor: ...
    @overload
    def __call__(self, inputs: Tensor, entries: FP8LatentCache, group_slots: Tensor, key_lens: Tensor,
                 block_table: Tensor, position_bias: Tensor, kv_norm: Tensor, cos: Tensor, sin: Tensor, /, *,
                 rate: int, overlap: bool, eps: float, num_seqs: int, inplace: bool) -> FP8LatentCache: ...
    @overload
    def __call__(self, inputs: Tensor, entries: FP8IndexCache, group_slots: Tensor, key_lens: Tensor,
                 block_table: Tensor, position_bias: Tensor, kv_norm: Tensor, cos: Tensor, sin: Tensor, /, *,
                 rate: int, overlap: bool, eps: float, num_seqs: int, inplace: bool) -> FP8IndexCache: ...

    def __call__(self, inputs: Tensor, entries: LatentCache | IndexCache, group_slots: Tensor, key_lens: Tensor,
                 block_table: Tensor, position_bias: Tensor, kv_norm: Tensor, cos: Tensor, sin: Tensor, /, *,
                 rate: int, overlap: bool, eps: float, num_seqs: int,
                 inplace: bool) -> LatentCache | IndexCache:
        """The compressor's update: inputs [nb, bs, 2 * c * Dc] (kv | gate of every token) through
        block_table [n, W]; each row with group_slots [n] >= 0 pools the block ending at its position
        (key_lens [n] - 1; with overlap, series Ca of the previous block and Cb of this one) by
        softmax(gate + position_bias [rate, c * Dc]) per channel, RMS-normalises it (kv_norm [Dc], eps),
        rotates its rope tail at the block's first position (cos, sin [P, R / 2]) and writes it to
        entries [nbg, bsg, Dc] at its slot (a tensor; an `FP8LatentCache` or `FP8IndexCache` takes it
        quantized as its write does); num_seqs bounds the completing rows -> entries."""
        ...


class HcSite(Protocol):
    def __call__(self, streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, norm_weight: Tensor, /, *,
                 iters: int, hc_eps: float, norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """One mHC site: streams [T, N, D]; fn [(2 + N) * N, N * D], base [(2 + N) * N], scale [3] float32;
        norm_weight [D] -> (x [T, D] in promote(norm_weight, streams) dtype, post [T, N], comb [T, N, N]
        float32): `reference.v4_hc.hc_mix_weights` of mixes = unit_rms(streams flattened, float32) @ fn^T, and x =
        rms_norm(sum_n pre[:, n] streams[:, n] rounded to the streams' dtype, norm_weight); both norms
        take norm_eps."""
        ...


class HcWriteBack(Protocol):
    def __call__(self, post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, /) -> Tensor:
        """A sublayer's write-back: post [T, N], comb [T, N, N] float32; out [T, D]; streams [T, N, D] ->
        new streams [T, N, D], new[:, k] = sum_j comb[:, j, k] streams[:, j] + post[:, k] out, the mix,
        the product and their sum each rounded to the streams' dtype."""
        ...


class HcWriteBackSite(Protocol):
    def __call__(self, post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, fn: Tensor, base: Tensor,
                 scale: Tensor, norm_weight: Tensor, /, *, iters: int, hc_eps: float, norm_eps: float
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`HcWriteBack`, then `HcSite` of the new streams with the next site's fn, base, scale and
        norm_weight -> (new streams [T, N, D], x [T, D], post [T, N], comb [T, N, N])."""
        ...


class HcHead(Protocol):
    def __call__(self, streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, /, *, hc_eps: float,
                 norm_eps: float) -> Tensor:
        """The hyper head, the model's last collapse: streams [T, N, D]; fn [N, N * D], base [N], scale [1]
        float32 -> sum_n pre[:, n] streams[:, n] [T, D] in the streams' dtype, pre = sigmoid(scale *
        (unit_rms(streams flattened, float32, norm_eps) @ fn^T) + base) + hc_eps."""
        ...


class ClampedExperts(Protocol):
    def __call__(self, x: Tensor, w13: Weight, w2: Weight, topk_weights: Tensor, topk_ids: Tensor, /, *,
                 limit: float) -> Tensor:
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with SwiGLU pre-activations
        clamped at `limit` (gate above, up both ways): x [T, D]; w13 [E, 2I, D]; w2 [E, D, I], tensors
        or stacked FP8 / FP4 pairs (computed as with their weights dequantized into x's dtype);
        topk_ids -1 takes no expert -> [T, D] in x's dtype."""
        ...


# ---- Sampling (`reference.sampling`) ----------------------------------------------------------


class GumbelMax(Protocol):
    def __call__(self, logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor, /) -> Tensor:
        """One token a row: logits [N, V] float32, bfloat16 or float16 (computed in float32);
        temperature [N] float32; seeds, positions [N] int64 -> [N] int64. A row with temperature
        < `reference.sampling.MIN_TEMPERATURE` takes the argmax of its logits, any other
        argmax_v(logits[v] / T + g[v]) with g = -log(-log(u)), u = `reference.sampling.uniform_noise`
        (seed, position, v), the division and both logs rounded as torch's float32 ones; ties go to
        the lowest index and a NaN wins, as `torch.argmax`. Bits equal the reference's."""
        ...


# ---- Collectives (`collectives`) --------------------------------------------------------------


class AllReduce(Protocol):
    def __call__(self, x: Tensor, /) -> Tensor:
        """The elementwise sum of x over every rank of the group: x [*] -> [*], same shape and dtype.
        Every rank gets the same bits. x is consumed (its buffer may hold the result); with one
        rank it is returned as it is."""
        ...


class AllGather(Protocol):
    def __call__(self, x: Tensor, /, *, dim: int) -> Tensor:
        """Every rank's x joined along `dim` in rank order: x [..., n, ...] -> [..., size * n, ...]
        (each rank's x of the same shape and dtype); with one rank, x itself."""
        ...


class ReduceScatter(Protocol):
    def __call__(self, x: Tensor, /, *, dim: int) -> Tensor:
        """The elementwise sum of x over every rank, cut along `dim` into size even pieces, of which
        this rank gets the rank-th: x [..., size * n, ...] -> [..., n, ...]; with one rank, x itself.
        x is consumed (its buffer may hold the result)."""
        ...
