"""The paged latent cache as a value the ops take: a tensor in the activations' dtype, or FP8 latents.

An MLA layer caches, per token, C = kv_lora_rank normalised latent values and R = qk_rope_head_dim
rotated RoPE values. `LatentCache` is what the attention ops' contracts take for that cache:

* a tensor [num_blocks, bs, C + R] in the activations' dtype (`kv_cache_dtype="auto"`);
* an `FP8LatentCache` (`kv_cache_dtype="fp8"`), FlashMLA's V3.2 cache semantics: the C latent values
  in float8_e4m3fn with one float32 scale per group of `FP8_GROUP` = 128 values (the last group
  partial when C is not a multiple of 128), and the R RoPE values kept in the activations' dtype.
  At DeepSeek's sizes (C = 512, R = 64, bf16) a token takes 512 + 4 * 4 + 64 * 2 = 656 bytes
  against 1152. One difference in what is written: FlashMLA's quantizer rounds each scale up to a
  power of two ("ue8m0"), this cache keeps the group's largest magnitude / 448 as it falls, so that
  value is stored exactly. On the demo model power-of-two scales tripled the logits' median error
  against the 16-bit cache (0.3% -> 1.0%) and lost up to 13% of the greedy tokens on random prompts,
  where these scales keep every one; a reader takes either, since it multiplies by whatever scale
  it finds.

The FP8 cache is three leaves (values, scales, rope) of one frozen pytree, not one packed byte
tensor with typed views. Each leaf then has one dtype, so everything that moves a state moves it
unchanged (cloning, copying into a graph's buffers, `copy=True` writes, the meta-device probes that
count bytes), the torch reference indexes it like any tensor, and a kernel reads each leaf through
its own base pointer and strides. The bytes a token are the same; FlashMLA's packed row (one
656-byte stride a token) only matters to FlashMLA's own kernels, which this package does not call.

Writing quantizes each token's latent values by group (`reference.cache.write_kv`: scale = the
group's largest magnitude / 448, values rounded to the nearest e4m3); reading dequantizes
(`FP8LatentCache.rows`): value * scale in float32, rounded once to the activations' dtype, which
is what every kernel feeds its products with, so all backends attend over the same keys.
The ops pick the path by the cache's type, one dispatch per op; model code never asks.

DeepSeek-V3.2's indexer keys (`DSALayerCache.index_k`) follow the same choice with a format of their own
(`index_cache.FP8IndexCache`); the MTP drafter's own cache stays in the activations' dtype. DeepSeek-V4's
keys (window keys and compressed entries, K = V: Dh - R values and R rotated ones) take this type too, with
C = Dh - R, and its CSA indexer keys V3.2's (`state.v4_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, Union, overload

import torch

from mla_func.pytree import register_dataclass, tree_map

from .index_cache import FP8IndexCache
from .reference.fp8 import FP8_DTYPE

# Latent values a scale covers: FlashMLA's tile of the 512-wide latent (four scales a token).
FP8_GROUP = 128
# What `init_state(kv_cache_dtype=...)` and `Engine(kv_cache_dtype=...)` take: "auto" caches in
# the activations' dtype, "fp8" as `FP8LatentCache`.
KV_CACHE_DTYPES = ("auto", "fp8")


def check_kv_cache_dtype(value: object, where: str = "kv_cache_dtype") -> None:
    """ValueError naming `where` and the bad value unless `value` is one of `KV_CACHE_DTYPES`."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"{where}: expected one of {KV_CACHE_DTYPES} (\"auto\": the activations' dtype), "
                         f"got {value!r}")


def scale_groups(kv_lora_rank: int) -> int:
    """Scales a token's C latent values take: ceil(C / FP8_GROUP)."""
    return -(-kv_lora_rank // FP8_GROUP)


@register_dataclass
@dataclass(frozen=True, slots=True)
class FP8LatentCache:
    """An MLA layer's latent cache with FP8 latent values (see the module docstring).

    values: [num_blocks, bs, C] float8_e4m3fn, the normalised c_kv divided by its group's scale
    scales: [num_blocks, bs, ceil(C / 128)] float32, each group's largest magnitude / 448
    rope:   [num_blocks, bs, R] the rotated k_pe, in the activations' dtype
    """

    values: torch.Tensor
    scales: torch.Tensor
    rope: torch.Tensor

    def __post_init__(self) -> None:
        if self.values.dtype != FP8_DTYPE or self.scales.dtype != torch.float32:
            raise ValueError(f"FP8LatentCache: values and scales must be {FP8_DTYPE} and torch.float32, got "
                             f"{self.values.dtype} and {self.scales.dtype}")
        if self.values.ndim != 3:
            raise ValueError(f"FP8LatentCache.values: expected [num_blocks, bs, C], got {tuple(self.values.shape)}")
        pages, c = tuple(self.values.shape[:2]), self.values.shape[2]
        want = {"scales": (*pages, scale_groups(c)), "rope": (*pages, self.rope.shape[-1])}
        for name, t in (("scales", self.scales), ("rope", self.rope)):
            if tuple(t.shape) != want[name]:
                raise ValueError(f"FP8LatentCache.{name}: values of shape {tuple(self.values.shape)} need "
                                 f"{want[name]}, got {tuple(t.shape)}")

    @property
    def shape(self) -> torch.Size:
        """[num_blocks, bs, C + R]: the shape of the cache it stands for (what `rows` gives rows of)."""
        nb, bs, c = self.values.shape
        return torch.Size((nb, bs, c + self.rope.shape[2]))

    @property
    def kv_lora_rank(self) -> int:
        return self.values.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the rope values' and the dequantized rows'."""
        return self.rope.dtype

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rope, values, scales): rope first, as it holds the activations' dtype, which a state reads
        from its first paged tensor (`KVCacheState.dtype`)."""
        return self.rope, self.values, self.scales

    def rows(self, *index: torch.Tensor) -> torch.Tensor:
        """The rows `cache[index]` dequantized: index one or two integer tensors over (block, offset),
        broadcast to [...] -> [..., C + R] in the activations' dtype, latent = values * scale taken
        in float32 and rounded once, then the rope values as stored."""
        values, scales = self.values[index].float(), self.scales[index]
        latent = values * scales.repeat_interleave(FP8_GROUP, dim=-1)[..., :values.shape[-1]]
        return torch.cat([latent.to(self.dtype), self.rope[index]], dim=-1)


# What the latent-cache ops' contracts take and return (`contracts`), and the same as a type variable, for
# the ops that return the type they were given.
LatentCache = Union[torch.Tensor, FP8LatentCache]
LatentCacheT = TypeVar("LatentCacheT", torch.Tensor, FP8LatentCache)
# A cache of DeepSeek-V4 compressed entries (`compress_entries` returns the type it takes): keys, as a latent
# cache, or CSA's indexer keys, whose FP8 form is `FP8IndexCache`.
EntryCacheT = TypeVar("EntryCacheT", torch.Tensor, FP8LatentCache, FP8IndexCache)


def latent_rows(cache: LatentCache, *index: torch.Tensor) -> torch.Tensor:
    """`cache[index]` in the activations' dtype: index one or two integer tensors over (block, offset)
    -> [..., C + R] (an FP8 cache dequantized, `FP8LatentCache.rows`)."""
    if isinstance(cache, torch.Tensor):
        return cache[index]
    return cache.rows(*index)


def latent_leaves(cache: LatentCache) -> tuple[torch.Tensor, ...]:
    """The cache's paged tensors, each [num_blocks, bs, ...], the one in the activations' dtype first."""
    return (cache,) if isinstance(cache, torch.Tensor) else cache.tensors()


@overload
def cloned(cache: torch.Tensor) -> torch.Tensor: ...
@overload
def cloned(cache: FP8LatentCache) -> FP8LatentCache: ...


def cloned(cache: LatentCache) -> LatentCache:
    """A copy of every leaf (an out-of-place write starts from it), of the type given."""
    return cache.clone() if isinstance(cache, torch.Tensor) else tree_map(torch.clone, cache)


def zeroed_latent(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, *, kv_cache_dtype: str,
                  dtype: torch.dtype, device: torch.device | str) -> LatentCache:
    """A zeroed latent cache of num_blocks x block_size tokens in `kv_cache_dtype` ("auto": a tensor
    [num_blocks, bs, C + R] in `dtype`; "fp8": an `FP8LatentCache` whose rope values are in `dtype`)."""
    check_kv_cache_dtype(kv_cache_dtype)
    pages = (num_blocks, block_size)
    if kv_cache_dtype == "auto":
        return torch.zeros(*pages, kv_lora_rank + rope_dim, dtype=dtype, device=device)
    return FP8LatentCache(values=torch.zeros(*pages, kv_lora_rank, dtype=FP8_DTYPE, device=device),
                          scales=torch.zeros(*pages, scale_groups(kv_lora_rank), dtype=torch.float32, device=device),
                          rope=torch.zeros(*pages, rope_dim, dtype=dtype, device=device))
