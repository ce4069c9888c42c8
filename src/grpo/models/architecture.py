"""What a model family can do under grpo, checked when the policy loads: a setting the architecture cannot honour is
a ConfigError naming the key, before the run writes anything, instead of an error (or wrong log-probs) mid-run.

- ``rollout.engine: hf-static`` keeps a static KV cache of full-attention layers: not for a model whose cache has
  sliding-window layers (Gemma 2/3, GPT-OSS, Mistral with ``sliding_window`` set), read off the cache transformers
  builds for the config (``full_attention_only``);
- ``train.pack_sequences``: the packed pass relies on transformers keeping packed rows apart by their position ids;
  GPT-OSS builds its attention mask without them (transformers 5.x), so its rows would attend to each other: one
  probe forward finds it (``packing_keeps_rows_apart``);
- ``train.fused_lm_head: true``: the fused head must reproduce the model's own logits (``grpo.models.logits_head``);
- ``loss.router_aux_loss_coef``: only for a model that returns router logits (``grpo.models.moe``);
- ``model.lora_target_modules`` as a list: every name must be a module of the model (peft adapts the names that
  match and says nothing of the others); the error lists the model's linear layers (``lora_target_names``).
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.config import ConfigError, RunConfig
from grpo.config.loss_rules import records_routing
from grpo.models.logits_head import head_reproduces_forward
from grpo.models.moe import router_loss
from grpo.models.routing_replay import replay_routers
from grpo.models.wrappers import inner_model

_PACKING_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> packing_keeps_rows_apart


def full_attention_only(model: torch.nn.Module) -> bool:
    """Whether every layer of the KV cache transformers builds for ``model``'s config is a plain full-attention one
    (``DynamicLayer``): what a static cache of ``[B, heads, C, d]`` buffers can stand for."""
    config = getattr(inner_model(model), "config", None)
    if config is None:
        return True
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def packing_keeps_rows_apart(model: torch.nn.Module) -> bool:
    """Whether a forward over two rows packed into one sequence (position ids restarting, no attention mask: the
    packed pass of ``grpo.step.logprobs``) gives each row the logits it has alone; one probe per model object,
    without gradient, dropout off."""
    inner = inner_model(model)
    if inner in _PACKING_PROBED:
        return _PACKING_PROBED[inner]
    device = next(inner.parameters()).device
    first, second = torch.tensor([[1, 2, 3]], device=device), torch.tensor([[4, 5]], device=device)
    training = inner.training
    try:
        inner.eval()
        with torch.no_grad():
            alone = torch.cat([inner(input_ids=row, use_cache=False).logits for row in (first, second)], 1).float()
            packed = inner(input_ids=torch.cat([first, second], 1), position_ids=torch.tensor([[0, 1, 2, 0, 1]],
                           device=device), use_cache=False).logits.float()
    finally:
        inner.train(training)
    apart = torch.allclose(packed, alone, rtol=1e-2, atol=1e-2)
    _PACKING_PROBED[inner] = apart
    return apart


def lora_target_names(model: torch.nn.Module) -> list[str]:
    """The names ``model.lora_target_modules`` can list: the last part of every linear layer's name but the LM
    head's (what ``all-linear`` adapts). Fused experts (a 3-D parameter per MoE layer) are not linear layers."""
    head = inner_model(model).get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def check_lora_targets(model: torch.nn.Module, target_modules: str | list[str]) -> None:
    """ConfigError naming ``model.lora_target_modules`` for a listed name that matches no module of ``model`` (peft's
    rule: the module's name is it or ends with ``.`` + it). ``all-linear`` and a regular expression are peft's."""
    if isinstance(target_modules, str):
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ConfigError(
            f"model.lora_target_modules: {missing} match no module of {type(inner_model(model)).__name__}; its "
            f"linear layers are {lora_target_names(model)} (or use 'all-linear')")


def check_architecture(cfg: RunConfig, model: torch.nn.Module) -> None:
    """ConfigError naming the key for a setting ``model``'s architecture cannot honour (the module docstring)."""
    name = type(inner_model(model)).__name__
    if cfg.rollout.engine == "hf-static" and not full_attention_only(model):
        raise ConfigError(f"rollout.engine: hf-static keeps a static cache of full-attention layers, and {name} has "
                          "sliding-window layers; use rollout.engine: hf (or auto, which picks it)")
    if cfg.train.pack_sequences and not packing_keeps_rows_apart(model):
        raise ConfigError(f"train.pack_sequences: {name}'s forward does not keep packed rows apart (transformers "
                          "builds its attention mask without their position ids), so the packed rows would attend "
                          "to each other; set it to false")
    if cfg.train.fused_lm_head and not head_reproduces_forward(model):
        raise ConfigError(f"train.fused_lm_head is true, but {name}'s forward changes the logits after its LM head "
                          "in a way the fused head does not reproduce: its log-probs would be wrong; set it to null "
                          "or false")
    router_loss(model, cfg.loss.router_aux_loss_coef)
    if records_routing(cfg):
        key = "loss.routing_replay" if cfg.loss.routing_replay else "log.routing_mismatch"
        try:
            replay_routers(model)
        except ValueError as error:
            raise ConfigError(f"{key}: {error}; set it to false") from None
