"""Small random DeepSeek-V4 checkpoints with a multi-token-prediction layer, and the MTP block's equations.

transformers' deepseek_v4 neither builds nor saves MTP layers (it skips `mtp.*` tensors), so the
layer is made here: its V4 layer is the last layer of a transformers model of one more layer (with
learned routing, as DeepSeek-V4's MTP layer has; a sliding-window layer, as released, or of the attention
type asked for, whose rate config.json's `mtp_compress_ratio` then gives), saved by transformers and
renamed from `model.layers.{L}.` to `mtp.0.`; its own tensors (e_proj, h_proj, enorm, hnorm, norm,
the hyper head) are drawn independently. The oracle (`v4_mtp_reference`) runs that transformers
layer inside DeepSeek-V4's MTPBlock equations:

    e = enorm(embed(t)); x = e_proj(e)[:, None] + h_proj(hnorm(h)); y = Block(x)
    logits = head(norm(hc_head(y)))      # the MTP's hyper head and norm, the model's head
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask

from support.checkpoint_edits import edit_config
from support.v4_reference import make_reference, save_reference

PREFIX = "mtp.0."


def _draw(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) >= 2:
        return torch.randn(shape, generator=generator) * shape[-1] ** -0.5
    if name.endswith("base"):
        return torch.randn(shape, generator=generator) * 0.5
    return 1.0 + 0.2 * torch.randn(shape, generator=generator)   # norm weights and the hyper head's scale


def v4_mtp_checkpoint(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, echo: bool = False,
                      mtp_layer_type: str = "sliding_attention", **overrides
                      ) -> tuple[DeepseekV4ForCausalLM, torch.nn.Module, dict[str, torch.Tensor]]:
    """A transformers V4 model saved at `path` with an MTP layer `mtp.0.*` added to its file.

    Returns (the model, the MTP layer's transformers decoder layer, the MTP tensors by name).
    echo: a drafter that guesses well on repetitive text: h_proj passes the streams through, e_proj
    is zero, the layer's output projections are small, its mHC sites keep each stream apart and its
    hyper head, norms and head are the model's, so its logits are near the target's one position back.
    mtp_layer_type: the MTP layer's attention type (config.json says it by its rate, `mtp_compress_ratio`).
    """
    model = save_reference(path, dtype, seed, **overrides)
    config = model.config
    layers = config.num_hidden_layers
    longer = make_reference(dtype, seed + 1000, **{
        **overrides, "num_hidden_layers": layers + 1,
        "layer_types": [*config.layer_types, mtp_layer_type],
        "mlp_layer_types": [*config.mlp_layer_types, "moe"]})
    with tempfile.TemporaryDirectory() as folder:
        longer.save_pretrained(folder)
        saved = {}
        for shard in sorted(Path(folder).glob("*.safetensors")):
            saved.update(load_file(shard))
    block = f"model.layers.{layers}."
    tensors = {PREFIX + name[len(block):]: value for name, value in saved.items() if name.startswith(block)}
    d, n = config.hidden_size, config.hc_mult
    generator = torch.Generator().manual_seed(seed + 2000)
    own = {"enorm.weight": (d,), "hnorm.weight": (d,), "norm.weight": (d,), "e_proj.weight": (d, d),
           "h_proj.weight": (d, d), "hc_head.hc_fn": (n, n * d), "hc_head.hc_base": (n,), "hc_head.hc_scale": (1,)}
    for name, shape in own.items():
        tensors[PREFIX + name] = _draw(name, shape, generator)
    if echo:
        _make_echo(tensors, model, n)
    tensors = {name: value.to(dtype) for name, value in tensors.items()}
    weights = load_file(path / "model.safetensors")
    save_file({**weights, **tensors}, path / "model.safetensors", metadata={"format": "pt"})
    if mtp_layer_type != "sliding_attention":
        edit_config(path, mtp_compress_ratio=config.compress_rates[mtp_layer_type])
    return model, longer.model.layers[layers], tensors


def _make_echo(tensors: dict[str, torch.Tensor], model: DeepseekV4ForCausalLM, n: int) -> None:
    d = model.config.hidden_size
    tensors[PREFIX + "e_proj.weight"] = torch.zeros(d, d)
    tensors[PREFIX + "h_proj.weight"] = torch.eye(d)
    tensors[PREFIX + "hnorm.weight"] = torch.ones(d)
    for name in ("attn.wo_b.weight", "ffn.shared_experts.w2.weight"):
        tensors[PREFIX + name] = tensors[PREFIX + name] * 0.05
    for name in [k for k in tensors if ".ffn.experts." in k and k.endswith("w2.weight")]:
        tensors[name] = tensors[name] * 0.05
    for site in ("attn", "ffn"):
        # comb's logits (the last N * N of (2 + N) * N) strongly diagonal: Sinkhorn keeps each stream apart.
        base = tensors[f"{PREFIX}hc_{site}_base"].clone()
        base[2 * n:] = 12.0 * torch.eye(n).flatten() - 6.0
        tensors[f"{PREFIX}hc_{site}_base"] = base
        tensors[f"{PREFIX}hc_{site}_fn"] = tensors[f"{PREFIX}hc_{site}_fn"] * 0.01
    head = model.model.hc_head
    tensors[PREFIX + "hc_head.hc_fn"] = head.hc_fn.detach().float().clone()
    tensors[PREFIX + "hc_head.hc_base"] = head.hc_base.detach().float().clone()
    tensors[PREFIX + "hc_head.hc_scale"] = head.hc_scale.detach().float().clone()
    tensors[PREFIX + "norm.weight"] = model.model.norm.weight.detach().float().clone()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def target_streams(model: DeepseekV4ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """transformers' streams before the model's hyper head: [n, N, D]."""
    seen = {}
    hook = model.model.hc_head.register_forward_hook(lambda module, args, out: seen.setdefault("streams", args[0]))
    try:
        model(torch.tensor([tokens]), use_cache=False)
    finally:
        hook.remove()
    return seen["streams"][0]


@torch.no_grad()
def v4_mtp_reference(model: DeepseekV4ForCausalLM, block: torch.nn.Module, tensors: dict[str, torch.Tensor],
                     tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [n, N, D] the target's streams, the MTP layer's streams y [n - 1, N, D] and logits [n - 1, V]
    of rows 0..n-2: row i reads token i + 1 and h[i])."""
    config = model.config
    w = {name.removeprefix(PREFIX): value.float() for name, value in tensors.items()}
    eps = config.rms_norm_eps
    h = target_streams(model, tokens)                                              # [n, N, D]
    ids = torch.tensor(tokens[1:])
    e = rms(model.model.embed_tokens(ids), w["enorm.weight"], eps) @ w["e_proj.weight"].T     # [n - 1, D]
    x = e[:, None] + rms(h[:-1], w["hnorm.weight"], eps) @ w["h_proj.weight"].T               # [n - 1, N, D]
    positions = torch.arange(len(ids))[None]
    embeds = e[None]
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None,
                                             cache=None, position_ids=positions)
    rope = model.model.rotary_emb
    position_embeddings = {kind: rope(embeds, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
    y = block(x[None], position_embeddings=position_embeddings, position_ids=positions, attention_mask=mask,
              input_ids=ids[None], cache=None)[0]                                 # [n - 1, N, D]
    flat = y.flatten(1)
    mixes = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)) @ w["hc_head.hc_fn"].T
    pre = torch.sigmoid(mixes * w["hc_head.hc_scale"] + w["hc_head.hc_base"]) + config.hc_eps      # [n - 1, N]
    collapsed = (pre[..., None] * y).sum(1)
    logits = rms(collapsed, w["norm.weight"], eps) @ model.lm_head.weight.T
    return h, y, logits
