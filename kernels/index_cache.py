"""DeepSeek-V3.2's paged indexer-key cache as a value the ops take: a tensor, or FP8 keys with a scale a token.

The lightning indexer caches one key of Di = index_head_dim values a token (`DSALayerCache.index_k`),
addressed like the latent cache. `IndexCache` is what `write_index_key` and `index_scores` take:

* a tensor [num_blocks, bs, Di] in the activations' dtype (`kv_cache_dtype="auto"`);
* an `FP8IndexCache` (`kv_cache_dtype="fp8"`), as DeepSeek's released V3.2 inference code keeps its
  indexer cache (`k_cache` in float8_e4m3fn beside a float32 `k_scale_cache`, one scale per 128 values,
  which is one a token at its Di of 128): the Di values in float8_e4m3fn and one float32 scale a
  token, the key's largest magnitude / 448. 132 bytes a token at Di = 128 against 256 in bf16.

Writing quantizes as the latent cache's FP8 write does (`reference.fp8.quantize_activations` with one
group a key: an IEEE division, rounded to the nearest e4m3); reading dequantizes exactly, value * scale
in float32 (`FP8IndexCache.__getitem__`: the cache indexed as a tensor cache is). A score
relu(q . key) * w takes the scale out of the dot product (relu(s x) = s relu(x) for a positive s), so a
kernel may multiply a key's logits by its scale instead.
The query stays in the activations' dtype: only the cache is quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from mla_func.pytree import register_dataclass

from .reference.fp8 import FP8_DTYPE


@register_dataclass
@dataclass(frozen=True, slots=True)
class FP8IndexCache:
    """An indexer-key cache with FP8 keys (see the module docstring).

    values: [num_blocks, bs, Di] float8_e4m3fn, each key divided by its scale
    scales: [num_blocks, bs, 1] float32, each key's largest magnitude / 448
    """

    values: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.values.dtype != FP8_DTYPE or self.scales.dtype != torch.float32:
            raise ValueError(f"FP8IndexCache: values and scales must be {FP8_DTYPE} and torch.float32, got "
                             f"{self.values.dtype} and {self.scales.dtype}")
        if self.values.ndim != 3 or tuple(self.scales.shape) != (*self.values.shape[:2], 1):
            raise ValueError(f"FP8IndexCache: values [num_blocks, bs, Di] need scales [num_blocks, bs, 1], got "
                             f"{tuple(self.values.shape)} and {tuple(self.scales.shape)}")

    @property
    def shape(self) -> torch.Size:
        """[num_blocks, bs, Di]: the shape of the cache it stands for."""
        return self.values.shape

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, scales): the paged leaves."""
        return self.values, self.scales

    def __getitem__(self, index: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The keys `cache[index]` dequantized, as a tensor cache is indexed: index one or two integer
        tensors over (block, offset) -> [..., Di] float32, value * scale (exact)."""
        return self.values[index].float() * self.scales[index]


# What the indexer-key ops' contracts take and return.
IndexCache = Union[torch.Tensor, FP8IndexCache]


def index_leaves(cache: IndexCache) -> tuple[torch.Tensor, ...]:
    """The cache's paged tensors, each [num_blocks, bs, ...]."""
    return (cache,) if isinstance(cache, torch.Tensor) else cache.tensors()


def zeroed_index_cache(num_blocks: int, block_size: int, index_head_dim: int, *, kv_cache_dtype: str,
                       dtype: torch.dtype, device: torch.device | str) -> IndexCache:
    """A zeroed indexer-key cache of num_blocks x block_size tokens: a tensor [num_blocks, bs, Di] in
    `dtype` ("auto"), or an `FP8IndexCache` ("fp8")."""
    pages = (num_blocks, block_size)
    if kv_cache_dtype == "auto":
        return torch.zeros(*pages, index_head_dim, dtype=dtype, device=device)
    if kv_cache_dtype != "fp8":
        raise ValueError(f"kv_cache_dtype: expected \"auto\" or \"fp8\", got {kv_cache_dtype!r}")
    return FP8IndexCache(values=torch.zeros(*pages, index_head_dim, dtype=FP8_DTYPE, device=device),
                         scales=torch.zeros(*pages, 1, dtype=torch.float32, device=device))
