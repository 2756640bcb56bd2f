"""The params pytree as trainable leaves, correction biases and constants."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..params import MoEParams, Params
from ..pytree import tree_flatten, tree_unflatten


class LeafLayout:
    """Splits the params pytree's leaves into trainable ones, correction biases and constants.

    Tied embeddings make `embed` and `lm_head` one tensor at two leaf positions:
    it is trained once (its gradient is the sum of both uses, which
    differentiation through the shared input gives for free).
    """

    def __init__(self, params: Params) -> None:
        leaves, self.spec = tree_flatten(params)
        constant_ids = {id(params.rope_cos), id(params.rope_sin)}
        # MoE layer order.
        self.biases: list[torch.Tensor] = [
            layer.mlp.e_score_correction_bias
            for layer in params.layers
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

    def params(self, trainable: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> Params:
        """The params pytree with these trainable leaves and correction biases."""
        leaves = []
        for kind, k in self.slots:
            leaves.append(trainable[k] if kind == "t" else biases[k] if kind == "b" else self.constants[k])
        return tree_unflatten(self.spec, leaves)
