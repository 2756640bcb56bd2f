"""Random weights for shape presets, made through the checkpoint path (`params_from_hf`)."""

from __future__ import annotations

import torch

from mla_func.checkpoint.fp8 import QUANTIZATION_CONFIG, block_quantize, is_quantized_name
from mla_func.core.config import ModelConfig
from mla_func.kernels.quantized import BlockFP8Weight, Weight
from mla_func.core.params import Params, params_from_hf
from mla_func.models.mtp.params import MTPParams, load_mtp, mtp_tensor_shapes
from mla_func.models.tensor_shapes import hf_tensor_shapes


def random_params(config: ModelConfig, *, dtype: torch.dtype, device: torch.device, seed: int, progress: bool,
                  max_model_len: int | None, mtp: bool = False, block: tuple[int, int] | None = None
                  ) -> tuple[Params, MTPParams | None]:
    """Random weights with the shapes of `config` made on `device` (and an MTP layer's with `mtp`).

    With `block`, every tensor an FP8 checkpoint stores quantized (`fp8.is_quantized_name`) is drawn
    as the others, then block-quantized (`fp8.block_quantize`): the params hold it as an FP8 pair.
    """
    quantized = {"quantization_config": QUANTIZATION_CONFIG} if block is not None else {}
    shapes = {**hf_tensor_shapes(config), **(mtp_tensor_shapes(config) if mtp else {})}
    generator = torch.Generator(device=device).manual_seed(seed)

    def fetch(name: str) -> Weight:
        tensor = draw(name)
        if block is not None and is_quantized_name(name, quantized):
            return BlockFP8Weight(*block_quantize(tensor, block), block)
        return tensor

    def draw(name: str) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            return torch.zeros(shape, device=device)
        if not config.family.held_dtype(name, torch.float32).is_floating_point:
            # An index table (hash routing's token -> experts), drawn uniformly.
            return torch.randint(0, config.n_routed_experts or 1, shape, device=device, generator=generator)
        if len(shape) == 1:  # norm weights
            return torch.ones(shape, device=device)
        # std 1/sqrt(fan_in) keeps activations of order one through every layer. Drawn in
        # float32 (and cast by params_from_hf), so a seed gives the same weights in every dtype.
        std = shape[1] ** -0.5
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)

    params = params_from_hf(config, fetch, dtype=dtype, device=device, progress=progress, max_model_len=max_model_len)
    return params, load_mtp(config, params, fetch, dtype, device, frozenset()) if mtp else None
