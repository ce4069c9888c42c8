"""Models to state dicts and back: what ``WeightStore.publish`` is given for a model (full or LoRA), and
loading a published version into a model in place, with errors that say what does not match."""

from __future__ import annotations

from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

from grpo.models.state_dicts import storage_key, unmatched_keys
from grpo.weight_store.files import _json_safe
from grpo.weight_store.layout import KINDS, Kind, LoadedWeights, WeightStoreError


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _is_peft(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


def state_dict_for_publish(model: torch.nn.Module, full: dict[str, torch.Tensor] | None = None,
                           ) -> tuple[dict[str, torch.Tensor], Kind, dict[str, Any] | None]:
    """``(state_dict, kind, adapter_config)`` to pass to ``WeightStore.publish``; ``full``: the model's full
    tensors gathered from its shards (ZeRO-3, FSDP2: ``grpo.parallel.learners.full_weights``), read in place of
    its own, which are shards.

    A DDP wrapper is unwrapped. A peft model gives its adapter tensors (``get_peft_model_state_dict``)
    and its active LoRA config as a JSON-compatible dict; any other model gives its full state dict
    with tied duplicates (e.g. ``lm_head.weight`` tied to the embeddings) left out, the first name of
    each group kept. Tensors are detached, contiguous and on the CPU; CPU tensors may share memory with
    the model's parameters, so publish them before the next optimizer step.
    """
    model = _unwrap(model)
    if _is_peft(model):
        state = get_peft_model_state_dict(model, state_dict=full)
        adapter_config: dict[str, Any] | None = _json_safe(model.peft_config[model.active_adapter].to_dict())
        kind: Kind = "lora"
    elif full is not None:  # gathered with each tied weight once
        state, adapter_config, kind = full, None, "full"
    else:
        state = model.state_dict()
        seen: set[tuple] = set()
        deduplicated = {}
        for name, tensor in state.items():
            key = storage_key(tensor)
            if key is not None and key in seen:
                continue  # a tied alias of a tensor already kept
            if key is not None:
                seen.add(key)
            deduplicated[name] = tensor
        state, adapter_config, kind = deduplicated, None, "full"
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}, kind, adapter_config


def apply_to_model(model: torch.nn.Module, loaded: LoadedWeights) -> None:
    """Load ``loaded`` into ``model`` in place (values copied into the existing parameters: their
    device and dtype stay).

    "full": strict (every weight present, no extra key; a tied alias such as ``lm_head.weight`` may be
    absent when the tensor it is tied to is present) into a causal LM that is not a peft model.
    "lora": the adapter tensors into a peft model with the same adapter keys and the same r / alpha.
    Raises WeightStoreError saying what does not match.
    """
    model = _unwrap(model)
    where = f"weights version {loaded.version} ({loaded.kind})"
    if loaded.kind == "lora":
        if not _is_peft(model):
            raise WeightStoreError(f"{where} holds a LoRA adapter, but the model is not a peft model")
        _apply_adapter(model, loaded, where)
    elif loaded.kind == "full":
        if _is_peft(model):
            raise WeightStoreError(f"{where} holds full model weights, but the model is a peft model")
        _apply_full(model, loaded, where)
    else:
        raise WeightStoreError(f"{where}: unknown kind {loaded.kind!r}; expected one of {KINDS}")


def _apply_full(model: torch.nn.Module, loaded: LoadedWeights, where: str) -> None:
    own = model.state_dict()
    state = loaded.state_dict
    missing, unexpected = unmatched_keys(own, state)
    if missing or unexpected:
        raise WeightStoreError(f"{where} does not match the model ({len(missing)} missing, e.g. {missing[:3]}; "
                               f"{len(unexpected)} unexpected, e.g. {unexpected[:3]})")
    wrong_shape = [k for k in state if tuple(state[k].shape) != tuple(own[k].shape)]
    if wrong_shape:
        k = wrong_shape[0]
        raise WeightStoreError(f"{where} does not fit the model: {len(wrong_shape)} shape mismatches, e.g. {k} "
                               f"{tuple(state[k].shape)} vs {tuple(own[k].shape)}")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)  # strictness checked above, tied aliases allowed


def _apply_adapter(model: torch.nn.Module, loaded: LoadedWeights, where: str) -> None:
    own_config = model.peft_config[model.active_adapter].to_dict()
    published = loaded.adapter_config or {}
    for key in ("r", "lora_alpha", "use_rslora"):  # a different scaling would load silently otherwise
        if key in published and published[key] != own_config.get(key):
            raise WeightStoreError(f"{where}: adapter {key}={published[key]!r} but the model's is "
                                   f"{own_config.get(key)!r}")
    own = get_peft_model_state_dict(model)
    missing, unexpected = sorted(set(own) - set(loaded.state_dict)), sorted(set(loaded.state_dict) - set(own))
    if missing or unexpected:
        raise WeightStoreError(f"{where}: adapter does not match the model (missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}); was it published with another LoRA config?")
    wrong_shape = [k for k in own if tuple(own[k].shape) != tuple(loaded.state_dict[k].shape)]
    if wrong_shape:
        k = wrong_shape[0]
        raise WeightStoreError(f"{where}: adapter does not fit the model, e.g. {k} "
                               f"{tuple(loaded.state_dict[k].shape)} vs {tuple(own[k].shape)}")
    with torch.no_grad():
        set_peft_model_state_dict(model, loaded.state_dict)
