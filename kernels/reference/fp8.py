"""Block-scaled FP8 weights: the math of a linear layer and of the fused MoE over them.

A weight is a pair (values [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32),
one scale per bn x bk block (128 x 128 in DeepSeek's checkpoints; edge blocks are partial):

    w[i, j] = values[i, j] * scale_inv[i // bn, j // bk]

Two products are defined on it, and kernels match one or the other:

* dequantized (`w8a8=False`): y = x @ w^T with w and x in float32 (wider for float64 x), cast once;
* w8a8 (`w8a8=True`, the checkpoints' "dynamic" activation scheme): x is quantized per token and
  group of bk columns (`quantize_activations`), each (token group, weight block) inner product of
  FP8 values is taken exactly, scaled by both scales, and the K blocks are summed in float32
  in ascending order.

Both take every scale in float32, so a kernel that multiplies FP8 values on tensor cores and applies
the scales once per K block computes the same function up to the order of float32 additions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import check_dtype, check_shape

FP8_DTYPE = torch.float8_e4m3fn
# The largest finite float8_e4m3fn value: a group's largest magnitude maps onto it.
FP8_MAX = 448.0
# A group's largest magnitude is taken as at least this, so an all-zero group gets a tiny positive
# scale instead of a division by zero (its values quantize to zeros whatever the scale).
AMAX_FLOOR = 1e-10
DEFAULT_BLOCK = (128, 128)
# How a group of activations is scaled (the checkpoints' `scale_fmt`): "fp32", its largest magnitude / 448 as
# it falls; "ue8m0" (DeepSeek-V3.1 and later), the power of two at or above its largest magnitude times 1/448,
# that magnitude taken as at least UE8M0_AMAX_FLOOR: DeepSeek's own `act_quant` with its scales rounded.
SCALE_FORMATS = ("fp32", "ue8m0")
UE8M0_AMAX_FLOOR = 1e-4


def scale_blocks(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid [ceil(n / bn), ceil(k / bk)] of an [n, k] weight."""
    return -(-n // block[0]), -(-k // block[1])


def check_fp8_weight(name: str, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """Raise ValueError unless values [..., N, K] float8_e4m3fn and scale_inv [..., nb, kb] float32 match."""
    check_dtype(name, values, (FP8_DTYPE,))
    check_dtype(f"{name} scale_inv", scale_inv, (torch.float32,))
    if values.ndim < 2:
        raise ValueError(f"{name}: expected [..., N, K] FP8 values, got shape {tuple(values.shape)}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block: expected two positive sizes (bn, bk), got {block}")
    check_shape(f"{name} scale_inv", scale_inv,
                (*values.shape[:-2], *scale_blocks(values.shape[-2], values.shape[-1], block)))


def check_scale_fmt(scale_fmt: object) -> None:
    """ValueError naming the value unless it is one of `SCALE_FORMATS`."""
    if not isinstance(scale_fmt, str) or scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FORMATS}, got {scale_fmt!r}")


def ue8m0_scales(amax: torch.Tensor) -> torch.Tensor:
    """amax [...] float32 (largest magnitudes) -> [...] float32: the power of two at or above
    max(amax, UE8M0_AMAX_FLOOR) * (1/448 in float32), rounded up by its bits (a mantissa that is not zero
    carries into the exponent); an infinite or NaN product gives itself."""
    scales = amax.clamp(min=UE8M0_AMAX_FLOOR) * torch.full((), 1.0 / FP8_MAX, device=amax.device)
    powers = ((scales.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isfinite(scales), powers, scales)


def quantize_activations(x: torch.Tensor, group: int = 128, *,
                         scale_fmt: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (x_fp8 [T, K] float8_e4m3fn, scales [T, ceil(K / group)] float32), x ~ x_fp8 * scale.

    Each token's columns are cut into groups of `group` (the last one partial when K is not a
    multiple). A group's scale (`SCALE_FORMATS`): "fp32", max(|x|, AMAX_FLOOR) / 448 in float32, so the
    group's largest magnitude maps onto e4m3's largest value; "ue8m0", `ue8m0_scales`, so it maps into
    (224, 448]. Rounding: x (widened to float32) / scale by IEEE division (exact for a power of two),
    clamped to +-448 (the division may step just past it), then rounded to the nearest e4m3 value, ties
    to even (torch's cast); small values become e4m3 subnormals or zero.
    """
    if x.ndim != 2:
        raise ValueError(f"x: expected [T, K], got shape {tuple(x.shape)}")
    if group < 1:
        raise ValueError(f"group: expected a positive size, got {group}")
    check_scale_fmt(scale_fmt)
    num_tokens, k_in = x.shape
    num_groups = -(-k_in // group)
    # Zero padding to whole groups leaves each group's largest magnitude unchanged.
    groups = F.pad(x.float(), (0, num_groups * group - k_in)).view(num_tokens, num_groups, group)
    amax = groups.abs().amax(dim=-1)
    if scale_fmt == "ue8m0":
        scales = ue8m0_scales(amax)
    else:
        # A tensor divisor, not the number: on CUDA torch divides by a Python scalar as a product with its
        # reciprocal, one rounding more than the IEEE division the kernels and the CPU take.
        scales = amax.clamp(min=AMAX_FLOOR) / torch.full((), FP8_MAX, device=x.device)
    scaled = (groups / scales[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return scaled.view(num_tokens, num_groups * group)[:, :k_in].to(FP8_DTYPE), scales


def row_scales(scale_inv: torch.Tensor, n: int, block_n: int) -> torch.Tensor:
    """scale_inv [..., nb, kb] -> [..., n, kb]: each weight row's scale for every K block."""
    return scale_inv.repeat_interleave(block_n, dim=-2)[..., :n, :]


def dequantize_weight(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [..., N, K] float8_e4m3fn, scale_inv [..., nb, kb] float32 -> w [..., N, K] in `dtype`.

    The product is taken in float32 and cast once.
    """
    check_fp8_weight("values", values, scale_inv, block)
    n, k = values.shape[-2:]
    scales = row_scales(scale_inv, n, block[0]).repeat_interleave(block[1], dim=-1)[..., :k]
    return (values.float() * scales).to(dtype)


def _w8a8_product(x_fp8: torch.Tensor, x_scales: torch.Tensor, values: torch.Tensor, w_rows: torch.Tensor,
                  block_k: int, acc_dtype: torch.dtype) -> torch.Tensor:
    """[T, K] FP8 with scales [T, kb] times [N, K] FP8 with row scales [N, kb] -> [T, N] in acc_dtype.

    A block's inner product of FP8 values is exact in float64: every product is a multiple of
    2^-18 below 2^18, so 128 of them sum exactly within 53 bits.
    """
    k_in = x_fp8.shape[1]
    acc = torch.zeros((x_fp8.shape[0], values.shape[0]), dtype=acc_dtype, device=x_fp8.device)
    for b, k0 in enumerate(range(0, k_in, block_k)):
        part = x_fp8[:, k0:k0 + block_k].double() @ values[:, k0:k0 + block_k].double().T
        acc += part.to(acc_dtype) * x_scales[:, b, None].to(acc_dtype) * w_rows[None, :, b].to(acc_dtype)
    return acc


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, *,
               block: tuple[int, int] = DEFAULT_BLOCK, w8a8: bool = False,
               out_dtype: torch.dtype | None = None, scale_fmt: str = "fp32") -> torch.Tensor:
    """y = x @ w^T for a block-scaled FP8 weight (see the module docstring for both products).

    x [T, K] float; values [N, K] float8_e4m3fn; scale_inv [ceil(N/bn), ceil(K/bk)] float32
    -> y [T, N] in out_dtype (x's by default). w8a8 quantizes x per token and group of bk columns,
    scaled as `scale_fmt` says (`quantize_activations`).
    """
    num_tokens, k_in = x.shape
    check_fp8_weight("values", values, scale_inv, block)
    check_shape("values", values, (None, k_in))
    out_dtype = out_dtype or x.dtype
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    if not w8a8:
        w = dequantize_weight(values, scale_inv, block, acc_dtype)
        return (x.to(acc_dtype) @ w.T).to(out_dtype)
    x_fp8, x_scales = quantize_activations(x, block[1], scale_fmt=scale_fmt)
    w_rows = row_scales(scale_inv, values.shape[0], block[0])
    return _w8a8_product(x_fp8, x_scales, values, w_rows, block[1], acc_dtype).to(out_dtype)


def _expert_products(x: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     w8a8: bool, scale_fmt: str) -> torch.Tensor:
    """x [T, K] times every expert's weight [E, N, K] -> [T, E, N] in promote(x's dtype, float32)."""
    num_experts, n, k = values.shape
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    if not w8a8:
        w = dequantize_weight(values, scale_inv, block, acc_dtype)
        return (x.to(acc_dtype) @ w.flatten(0, 1).T).view(-1, num_experts, n)
    x_fp8, x_scales = quantize_activations(x, block[1], scale_fmt=scale_fmt)
    w_rows = row_scales(scale_inv, n, block[0]).flatten(0, 1)
    return _w8a8_product(x_fp8, x_scales, values.flatten(0, 1), w_rows, block[1], acc_dtype).view(-1, num_experts, n)


def check_fp8_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                  w2_scale_inv: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  block: tuple[int, int]) -> int:
    """Raise ValueError unless the arguments of `fp8_fused_moe` agree (shapes, FP8 pairs); return E."""
    num_tokens, hidden = x.shape
    check_fp8_weight("w13", w13, w13_scale_inv, block)
    check_fp8_weight("w2", w2, w2_scale_inv, block)
    num_experts, two_inter, _ = w13.shape
    check_shape("w13", w13, (num_experts, two_inter - two_inter % 2, hidden))
    check_shape("w2", w2, (num_experts, hidden, two_inter // 2))
    check_shape("topk_weights", topk_weights, (num_tokens, None))
    check_shape("topk_ids", topk_ids, tuple(topk_weights.shape))
    return num_experts


def fp8_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block: tuple[int, int] = DEFAULT_BLOCK,
    w8a8: bool = False,
    out_dtype: torch.dtype | None = None,
    scale_fmt: str = "fp32",
) -> torch.Tensor:
    """`reference.moe.fused_moe` with block-scaled FP8 experts.

    x:             [T, D] float
    w13:           [E, 2I, D] float8_e4m3fn, rows [0, I) gate, [I, 2I) up; w13_scale_inv [E, ceil(2I/bn), ceil(D/bk)]
    w2:            [E, D, I] float8_e4m3fn; w2_scale_inv [E, ceil(D/bn), ceil(I/bk)]
    topk_weights:  [T, k] float32; topk_ids [T, k] integer, -1 takes no expert
    returns        [T, D] in out_dtype (x's by default)

    Each expert's gate/up product is `fp8_linear`'s (w8a8: of x quantized once per token); the
    activation silu(gate) * up is rounded to x's dtype, as the bf16 MoE keeps it, then (w8a8)
    quantized per token and group for the down product (both quantizations scaled as `scale_fmt` says).
    The down products and their weighted sum over experts are taken in promote(x's dtype, float32).
    Every expert runs on every token.
    """
    num_tokens, hidden = x.shape
    num_experts = check_fp8_moe(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block)
    gate, up = _expert_products(x, w13, w13_scale_inv, block, w8a8, scale_fmt).chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(x.dtype)                                              # [T, E, I]
    down = torch.stack([_expert_products(act[:, e], w2[e:e + 1], w2_scale_inv[e:e + 1], block, w8a8, scale_fmt)[:, 0]
                        for e in range(num_experts)], dim=1)                           # [T, E, D]
    # -1 goes to a spare column that is dropped, so padded rows combine nothing.
    ids = torch.where(topk_ids >= 0, topk_ids, num_experts).long()
    combine = torch.zeros(num_tokens, num_experts + 1, dtype=down.dtype, device=x.device)
    combine = combine.scatter_add(1, ids, topk_weights.to(down.dtype))[:, :num_experts]   # [T, E]
    return torch.einsum("te,ted->td", combine, down).to(out_dtype or x.dtype)
