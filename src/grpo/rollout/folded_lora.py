"""A LoRA policy sampled with its adapters folded into the weights they adapt (the lean ``hf`` engine).

W + BA is computed once per call instead of two extra matmuls per layer per token, and the block samples with the
adapter layers disabled and the folded tensors in place of the base weights (the base weights themselves are never
written). With weights updated in flight (``grpo.rollout.in_flight``) a newer adapter is loaded in place into the
LoRA layers mid-call; the folded tensors would then still hold the old one, drawing tokens that the record credits
to the new version. So ``FoldedLora.refresh`` refolds, in place, whenever the loaded version changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from torch import Tensor

from grpo.rollout.in_flight import InFlight


def adapted_layers(model: torch.nn.Module) -> dict[str, LoraLayer] | None:
    """``{base weight's parameter name: LoRA layer}`` of a peft model's unmerged layers with an active adapter;
    None for any other model, or one whose base weights are packed 4-bit (QLoRA: sampled through peft's own
    forward, there is no float weight to fold into)."""
    if not isinstance(model, PeftModel):
        return None
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not module.merged and hasattr(module.base_layer, "weight"):
            if any(a in module.lora_A for a in module.active_adapters):
                if not module.base_layer.weight.is_floating_point():
                    return None
                layers[f"{name}.base_layer.weight"] = module
    return layers or None


def folded_weight(layer: LoraLayer, base: Tensor) -> Tensor:
    """``base`` (the layer's W) + the delta of its active adapters, as peft's own merge computes it, in W's dtype
    (a bf16 base stays bf16)."""
    delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
    return base + delta.to(base.dtype)


@contextmanager
def weights_swapped(model: torch.nn.Module, values: dict[str, Tensor]):
    """Run the block with ``values`` as those parameters' data, then put the original tensors back (they are
    never written, so frozen base weights cannot drift). Cheaper than ``functional_call``, which re-binds the
    whole module tree on every forward: 40% of a LoRA sampling step on a 2-core CPU."""
    params = {name: model.get_parameter(name) for name in values}
    originals = {name: param.data for name, param in params.items()}
    try:
        for name, param in params.items():
            param.data = values[name]
        yield
    finally:
        for name, param in params.items():
            param.data = originals[name]


class FoldedLora:
    """A peft model's adapted weights folded (``of``), to sample with inside ``swapped()``. Given an ``InFlight``,
    its ``refresh`` is called first, so that the fold is of the adapter it loaded; ``refresh()`` then stands in for
    it (its first call answered by that one: the prefill's, so the calls stay the ones the engine makes) and
    refolds whenever it returns another version (only then)."""

    def __init__(self, model: torch.nn.Module, layers: dict[str, LoraLayer], in_flight: InFlight | None = None):
        self.model, self.layers, self.in_flight = model, layers, in_flight
        self.version = in_flight.refresh() if in_flight is not None else None  # the version folded below
        self.answered = False  # that refresh stands for the prefill's, the first asked of ``refresh()``
        self.base = {name: model.get_parameter(name).data for name in layers}  # W: the tensors never written
        self.folded = {name: folded_weight(layer, self.base[name]) for name, layer in layers.items()}

    @classmethod
    def of(cls, model: torch.nn.Module, in_flight: InFlight | None = None) -> "FoldedLora | None":
        """The fold of ``model``'s adapters; None for a model without any (``adapted_layers``)."""
        layers = adapted_layers(model)
        return cls(model, layers, in_flight) if layers is not None else None

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The block samples with the adapter layers off, their base weights replaced by W + delta."""
        with self.model.disable_adapter(), weights_swapped(self.model, self.folded):
            yield

    def refresh(self) -> int:
        """The ``InFlight``'s refresh; when the version it returns is not the folded one (a newer adapter was
        loaded into the LoRA layers), W + delta is recomputed into the folded tensors in place: they are the data
        the swapped parameters hold, so the next forward reads them."""
        if not self.answered:  # the prefill's: asked for the fold just before
            self.answered = True
            return self.version
        version = self.in_flight.refresh()
        if version != self.version:
            for name, layer in self.layers.items():
                self.folded[name].copy_(folded_weight(layer, self.base[name]))
            self.version = version
        return version

    def following(self) -> InFlight:
        """The ``InFlight`` to sample with: the given one's tokens between checks, ``refresh`` as its refresh."""
        return InFlight(self.in_flight.check_tokens, self.refresh)
