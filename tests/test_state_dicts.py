"""grpo.models.state_dicts: tied keys found by storage, and key matching that lets a tied weight be saved once."""

import torch

from grpo.models.state_dicts import tied_aliases, unmatched_keys


def _tied_model() -> torch.nn.Module:
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False),
                                 "norm": torch.nn.LayerNorm(3)})
    model["head"].weight = model["embed"].weight
    return model


def test_tied_aliases_pair_keys_of_one_tensor_only():
    own = _tied_model().state_dict()
    aliases = tied_aliases(own)
    assert aliases["embed.weight"] == {"head.weight"} and aliases["head.weight"] == {"embed.weight"}
    assert aliases["norm.weight"] == set() and aliases["norm.bias"] == set()
    # equal values in different memory are not aliases; empty tensors alias nothing
    assert tied_aliases({"a": torch.zeros(2), "b": torch.zeros(2), "e": torch.empty(0)}) == {"a": set(), "b": set()}


def test_unmatched_keys_allow_one_name_of_a_tied_weight():
    own = _tied_model().state_dict()
    state = {k: v for k, v in own.items() if k != "head.weight"}
    assert unmatched_keys(own, state) == ([], [])
    state = {k: v for k, v in own.items() if k != "embed.weight"}
    assert unmatched_keys(own, state) == ([], [])
    state = {"norm.weight": own["norm.weight"], "extra": torch.zeros(1), "another": torch.zeros(1)}
    assert unmatched_keys(own, state) == (["embed.weight", "head.weight", "norm.bias"], ["another", "extra"])
