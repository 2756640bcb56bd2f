"""DeepSeek's released V4 config.json spellings, read as transformers' deepseek_v4 configuration reads them.

DeepSeek-V4-Flash and -Pro ship config.json in the spelling of DeepSeek's own inference code;
transformers' `DeepseekV4Config` folds each released field into one of its own (V4-Flash's values):

* `compress_ratios` ([0, 0, 4, 128, 4, 128, ..., 4, 0]: one entry a layer, then one a
  multi-token-prediction layer, 44 for 43 layers) -> `layer_types`, entry by entry: 0 ->
  sliding_attention, 4 -> compressed_sparse_attention, 128 -> heavily_compressed_attention; the entry
  of the first MTP layer (index num_hidden_layers) -> `mtp_compress_ratio` (mla-func's own field: transformers
  builds no MTP layer and drops it; absent, the MTP layer is a sliding one, 0), checked against the rate of
  its type as the layers' entries are; entries past it are dropped, as mla-func runs only the first MTP layer;
* `compress_rate_csa`, `compress_rate_hca` (older configs) -> `compress_rates[type]`;
* `num_hash_layers` (3) -> `mlp_layer_types`: that many "hash_moe" (at most num_hidden_layers), then "moe";
* `rope_theta` (10000) -> `rope_parameters.main`, a default rope;
* `rope_scaling` ({"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
  "original_max_position_embeddings": 65536}) -> `rope_parameters.compress`: that block with
  rope_theta = `compress_rope_theta` (160000) and, for yarn, attention_factor 1.0 (a flat
  `rope_parameters` block is read the same way);
* `qk_rope_head_dim` (64 of head_dim 512) -> `partial_rotary_factor` (64 / 512) of both rope blocks.

(`topk_method: "noaux_tc"`, V4's bias-corrected top-k over all experts, is checked by `refuse_unsupported_v4`.)

`transformers_form(raw)` rewrites a config.json dict into the fields `v4_from_hf` reads. Where a fact is
given in both spellings (compress_ratios and layer_types, num_hash_layers and mlp_layer_types,
rope_scaling and rope_parameters, qk_rope_head_dim and partial_rotary_factor, compress_rate_csa and
compress_rates, ...) the two must agree: transformers silently keeps one of them, mla-func refuses the
config naming both fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mla_func.core.config import ConfigError, RopeConfig, refuse
from mla_func.core.config_fields import check_int, is_int, is_number
from mla_func.models.v4.config import CSA, HCA, SLIDING, rope_block

__all__ = ["DEFAULT_RATES", "MTP_RATIO_FIELD", "RATIO_LAYER_TYPES", "RELEASED_FIELDS", "transformers_form"]

# compress_ratios' values: tokens pooled into one compressed entry (0: none) -> the layer's type.
RATIO_LAYER_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
# The released fields `transformers_form` folds into others.
RELEASED_FIELDS = frozenset({"compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers",
                             "rope_scaling"})
_RATE_FIELDS = {CSA: "compress_rate_csa", HCA: "compress_rate_hca"}
# The field `compress_ratios`' entry of the first MTP layer folds into (`V4Config.mtp_compress_ratio`).
MTP_RATIO_FIELD = "mtp_compress_ratio"
DEFAULT_RATES = {CSA: 4, HCA: 128}


def _disagree(field_a: str, value_a: Any, field_b: str, value_b: Any) -> ConfigError:
    return refuse(field_a, value_a, f"but {field_b} = {value_b!r}: two spellings of one fact must agree")


def _num_layers(raw: Mapping[str, Any], reading: str) -> int:
    n = raw.get("num_hidden_layers")
    if n is None:
        raise refuse("num_hidden_layers", None, f"missing (required to read {reading})")
    check_int("num_hidden_layers", n, 1)
    return int(n)


def _layer_types(raw: Mapping[str, Any], out: dict[str, Any]) -> list[int] | None:
    """compress_ratios -> layer_types and, where it has an entry past the layers, mtp_compress_ratio (set in
    `out`); returns the ratios of the num_hidden_layers layers and of the first MTP layer, where given."""
    ratios = raw.get("compress_ratios")
    if ratios is None:
        return None
    n = _num_layers(raw, "compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < n:
        raise refuse("compress_ratios", ratios, f"must list at least num_hidden_layers={n} entries, one a layer "
                     f"(then one a multi-token-prediction layer), each one of {sorted(RATIO_LAYER_TYPES)}")
    for i, ratio in enumerate(ratios):
        if not is_int(ratio) or ratio not in RATIO_LAYER_TYPES:
            raise refuse("compress_ratios", ratio, f"expected one of {sorted(RATIO_LAYER_TYPES)} "
                         "(0: sliding window only, 4: CSA, 128: HCA)", index=i)
    derived = [RATIO_LAYER_TYPES[ratio] for ratio in ratios[:n]]
    given = raw.get("layer_types")
    if given is not None and given != derived:
        raise _disagree("layer_types", given, "compress_ratios", ratios)
    out["layer_types"] = derived
    if len(ratios) == n:
        return list(ratios)
    given_mtp = raw.get(MTP_RATIO_FIELD)
    if given_mtp is not None and given_mtp != ratios[n]:
        raise _disagree(MTP_RATIO_FIELD, given_mtp, f"compress_ratios[{n}] (the first MTP layer's)", ratios[n])
    out[MTP_RATIO_FIELD] = ratios[n]
    return list(ratios[:n + 1])


def _compress_rates(raw: Mapping[str, Any], used_ratios: list[int] | None, out: dict[str, Any]) -> None:
    """compress_rate_csa / compress_rate_hca -> compress_rates (set in `out`), each type's rate checked
    against its other spellings (compress_rates, and the 4 or 128 of its layers, the first MTP
    layer's included, in compress_ratios)."""
    rates = raw.get("compress_rates")
    # type -> [(field, the rate it gives, its value as shown in an error)]
    spelled: dict[str, list[tuple[str, Any, Any]]] = {CSA: [], HCA: []}
    for ratio in sorted(set(used_ratios or ())):
        if ratio:
            spelled[RATIO_LAYER_TYPES[ratio]].append(("compress_ratios", ratio, raw["compress_ratios"]))
    if isinstance(rates, Mapping):
        for kind in spelled:
            if kind in rates:
                spelled[kind].append((f"compress_rates.{kind}", rates[kind], rates[kind]))
    for kind, name in _RATE_FIELDS.items():
        if raw.get(name) is not None:
            check_int(name, raw[name], 1)
            spelled[kind].append((name, raw[name], raw[name]))
    for spellings in spelled.values():
        first, rate, shown = spellings[0] if spellings else ("", None, None)
        for name, value, _ in spellings[1:]:
            if value != rate:
                raise _disagree(name, value, first, shown)
    legacy = {kind: raw[name] for kind, name in _RATE_FIELDS.items() if raw.get(name) is not None}
    if (legacy or used_ratios is not None) and (rates is None or isinstance(rates, Mapping)):
        # transformers' defaults, which compress_ratios' 4 and 128 spell too.
        out["compress_rates"] = {**DEFAULT_RATES, **(rates or {}), **legacy}


def _mlp_layer_types(raw: Mapping[str, Any], out: dict[str, Any]) -> None:
    """num_hash_layers -> mlp_layer_types (set in `out`)."""
    hashed = raw.get("num_hash_layers")
    if hashed is None:
        return
    n = _num_layers(raw, "num_hash_layers")
    check_int("num_hash_layers", hashed, 0)
    k = min(n, int(hashed))
    derived = ["hash_moe"] * k + ["moe"] * (n - k)
    given = raw.get("mlp_layer_types")
    if given is not None and given != derived:
        raise _disagree("mlp_layer_types", given, "num_hash_layers", hashed)
    out["mlp_layer_types"] = derived


def _partial(raw: Mapping[str, Any]) -> tuple[str, Any] | None:
    """(the field it is read from, the partial rotary factor): partial_rotary_factor, else
    qk_rope_head_dim / head_dim; None when neither is given."""
    partial, rope_dim = raw.get("partial_rotary_factor"), raw.get("qk_rope_head_dim")
    if rope_dim is None:
        return None if partial is None else ("partial_rotary_factor", partial)
    check_int("head_dim", raw.get("head_dim"), 1)
    head_dim: int = raw["head_dim"]
    if not is_int(rope_dim) or rope_dim % 2 or not 2 <= rope_dim < head_dim:
        raise refuse("qk_rope_head_dim", rope_dim, f"must be an even integer in [2, head_dim={head_dim}): "
                     "the rotated channels, leaving a non-rotated part")
    if partial is None:
        if head_dim * (rope_dim / head_dim) != rope_dim:
            # transformers rotates int(head_dim * partial_rotary_factor) channels: one fewer when this rounds down.
            raise refuse("qk_rope_head_dim", rope_dim, f"qk_rope_head_dim / head_dim * head_dim={head_dim} is not "
                         "exactly qk_rope_head_dim in floating point: give partial_rotary_factor (or rope_parameters)")
        return "qk_rope_head_dim", rope_dim / head_dim
    # transformers keeps partial_rotary_factor and sets qk_rope_head_dim = int(head_dim * partial_rotary_factor).
    if not is_number(partial) or not math.isfinite(partial) or int(head_dim * partial) != rope_dim:
        raise _disagree("qk_rope_head_dim", rope_dim, "partial_rotary_factor", partial)
    return "partial_rotary_factor", partial


def _ropes(blocks: Mapping[str, Any]) -> tuple[tuple[RopeConfig, Any], ...] | None:
    """Both blocks of a nested rope_parameters as read (None where one is not a JSON object)."""
    main, compress = blocks.get("main"), blocks.get("compress")
    if not isinstance(main, Mapping) or not isinstance(compress, Mapping):
        return None
    return rope_block("rope_parameters.main", main, 10000.0), rope_block("rope_parameters.compress", compress, 160000.0)


def _rope_parameters(raw: Mapping[str, Any], out: dict[str, Any]) -> None:
    """rope_scaling (or a flat rope_parameters block), rope_theta, compress_rope_theta and the partial
    rotary factor -> rope_parameters {"main", "compress"} (set in `out`)."""
    given, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise refuse("rope_scaling", scaling, "must be a JSON object (the compressed layers' rope)")
    nested = isinstance(given, Mapping) and ("main" in given or "compress" in given)
    if (nested and not scaling) or (given is not None and not isinstance(given, Mapping)):
        return  # transformers' form already, or a value the reader refuses by name
    # transformers reads `rope_scaling or rope_parameters`: a flat block is the compressed layers' rope.
    source = "rope_scaling" if scaling else "rope_parameters"
    flat = dict(scaling) if scaling else dict(given or {})
    partial = _partial(raw)
    if partial is None:
        raise refuse("rope_parameters", given, "missing: neither it nor qk_rope_head_dim or partial_rotary_factor "
                     "(the rotated share of head_dim, to build it from) is given")
    partial_field, partial_value = partial
    compress_theta = raw.get("compress_rope_theta", 160000.0)
    for key, field, value in (("rope_theta", "compress_rope_theta", compress_theta),
                              ("partial_rotary_factor", partial_field, partial_value)):
        if key in flat and flat[key] != value:
            raise _disagree(f"{source}.{key}", flat[key], field, value)
    compress = {**flat, "rope_theta": compress_theta, "partial_rotary_factor": partial_value}
    compress.setdefault("rope_type", flat.get("type", "default"))
    if compress["rope_type"] == "yarn":
        # DeepSeek's reference never scales cos / sin by YaRN's mscale.
        compress.setdefault("attention_factor", 1.0)
    rope_block(source, compress, compress_theta)   # an error names the field the block came from
    built = {"main": {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0),
                      "partial_rotary_factor": partial_value}, "compress": compress}
    if isinstance(given, Mapping) and nested:
        if _ropes(built) != _ropes(given):
            raise _disagree("rope_scaling", scaling, "rope_parameters", given)
        return
    out["rope_parameters"] = built


def transformers_form(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A deepseek_v4 config.json dict with each released spelling (module docstring) folded into the fields
    transformers' DeepseekV4Config writes; a dict already in that form comes back equal.

    ConfigError names the field for a released value mla-func cannot read (a compress_ratios shorter than
    num_hidden_layers or with a ratio other than 0, 4, 128; a negative num_hash_layers; a rope_scaling that
    is not an object) and names both fields where two spellings of one fact disagree (the MTP layer's
    compress_ratios entry and mtp_compress_ratio among them).
    """
    out = {name: value for name, value in raw.items() if name not in RELEASED_FIELDS}
    used_ratios = _layer_types(raw, out)
    _compress_rates(raw, used_ratios, out)
    _mlp_layer_types(raw, out)
    _rope_parameters(raw, out)
    return out
