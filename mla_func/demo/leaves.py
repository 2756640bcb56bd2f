"""The trained pytree (the model's params and its MTP layer) as trainable leaves, correction biases and constants."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_func.core.params import Params
from mla_func.models.mla.params import LayerParams, MoEParams
from mla_func.models.mtp.params import MTPParams
from mla_func.pytree import tree_flatten, tree_unflatten

# What training updates: the model's params and, when it has one, its MTP layer.
TrainTree = tuple[Params, MTPParams | None]


def _layers(tree: TrainTree) -> list[LayerParams]:
    params, mtp = tree
    return [*params.layers, *([] if mtp is None else [mtp.layer])]


class LeafLayout:
    """Splits the leaves of (params, mtp) into trainable ones, correction biases and constants.

    Tied embeddings make `embed` and `lm_head` one tensor at two leaf positions, and
    the MTP layer shares both (as DeepSeek-V3's does): a tensor is trained once, at
    whatever positions it sits (its gradient is the sum of every use, which
    differentiation through the shared input gives for free).
    """

    def __init__(self, params: Params, mtp: MTPParams | None = None) -> None:
        tree: TrainTree = (params, mtp)
        leaves, self.spec = tree_flatten(tree)
        constant_ids = {id(params.rope_cos), id(params.rope_sin)}
        # MoE layer order: the model's layers, then the MTP layer's (the order the forwards route in).
        self.biases: list[torch.Tensor] = [
            layer.mlp.e_score_correction_bias
            for layer in _layers(tree)
            if isinstance(layer.mlp, MoEParams) and layer.mlp.e_score_correction_bias is not None
        ]
        bias_ids = [id(b) for b in self.biases]
        self.trainable: list[torch.Tensor] = []
        self.constants: dict[int, torch.Tensor] = {}
        # slot per leaf position: ("t", k) trainable k, ("b", k) bias k, ("c", position) constant
        self.slots: list[tuple[str, int]] = []
        seen: dict[int, int] = {}
        for pos, leaf in enumerate(leaves):
            if id(leaf) in bias_ids:
                self.slots.append(("b", bias_ids.index(id(leaf))))
            elif id(leaf) in constant_ids or not leaf.is_floating_point():
                self.constants[pos] = leaf
                self.slots.append(("c", pos))
            else:
                if id(leaf) not in seen:
                    seen[id(leaf)] = len(self.trainable)
                    self.trainable.append(leaf)
                self.slots.append(("t", seen[id(leaf)]))

    def tree(self, trainable: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> TrainTree:
        """(params, mtp) with these trainable leaves and correction biases."""
        leaves = []
        for kind, k in self.slots:
            leaves.append(trainable[k] if kind == "t" else biases[k] if kind == "b" else self.constants[k])
        params, mtp = tree_unflatten(self.spec, leaves)
        return params, mtp
