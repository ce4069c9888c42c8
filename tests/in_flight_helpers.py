"""Helpers shared by the in-flight weight update tests (test_in_flight*.py): a ``refresh`` that loads newer weights
on a given call, a plain token-by-token reference loop that loads them at a given token, and a tiny LoRA policy
with a newer adapter published as the trainer publishes one."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from peft import LoraConfig, get_peft_model

from grpo.decoupled.sampler_role import SamplerWeights
from grpo.models.tiny import build_qwen2
from grpo.rollout.lean import draw_tokens
from grpo.weight_store import WeightStore, state_dict_for_publish

SEED, TEMPERATURE = 3, 1.3


class Publisher:
    """``refresh`` for the engine: calls ``load`` (newer weights into the model, in place) on its ``load_on``-th
    call (the first is the prefill's); version 0 before, 1 after."""

    def __init__(self, load: Callable[[], None], load_on: int):
        self.load, self.load_on, self.calls, self.version = load, load_on, 0, 0

    def refresh(self) -> int:
        self.calls += 1
        if self.calls == self.load_on:
            self.load()
            self.version = 1
        return self.version


@torch.no_grad()
def reference_loop(model, prompt: list[int], load: Callable[[], None], swap_after: int, max_tokens: int,
                   eos: list[int]) -> tuple[list[int], list[float]]:
    """One row, token by token over a DynamicCache: ``load`` puts the newer weights in once token
    ``swap_after - 1`` is drawn (the cache of the tokens so far kept; never for -1). Returns the tokens and each
    one's log-prob."""
    generator = torch.Generator().manual_seed(SEED)
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, logits, tokens, logprobs = out.past_key_values, out.logits[:, -1], [], []
    for t in range(max_tokens):
        scaled = logits.float() / TEMPERATURE  # [1, V]
        token = draw_tokens(scaled.softmax(-1), generator)  # [1]
        tokens.append(int(token))
        logprobs.append(float(torch.log_softmax(scaled, -1)[0, token]))
        if int(token) in eos:
            break
        if t + 1 == swap_after:
            load()
        out = model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return tokens, logprobs


def lora_policy(tokenizer):
    """A tiny peft LoRA policy on every linear layer, adapter "v1" (lora_A and lora_B drawn from seed 0)."""
    model = get_peft_model(build_qwen2(tokenizer, hidden_size=32, num_layers=2, seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).eval()
    set_adapter(model, 0)
    return model


@torch.no_grad()
def set_adapter(model, seed: int) -> None:
    """The adapter's tensors drawn from ``seed``, large enough to change what the tiny model samples."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.normal_(std=0.3, generator=generator)


def published_adapter(model, tmp_path, seed: int) -> WeightStore:
    """A run folder whose version 1 is the adapter drawn from ``seed``, published as the trainer publishes a LoRA
    policy (kind "lora": the adapter tensors only); ``model``'s own adapter is left as it was."""
    own = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    set_adapter(model, seed)
    state, kind, config = state_dict_for_publish(model)
    store = WeightStore(tmp_path / "run")
    store.publish(1, state, kind=kind, adapter_config=config)
    model.load_state_dict(own, strict=False)
    return store


def sampler_loads(policy, engine, store: WeightStore):
    """What ``refresh`` calls in the sampler: version 1 announced (the sender's ``latest_weights``), then loaded
    into ``policy`` (the one ``engine`` samples) by ``SamplerWeights.newest``."""
    weights = SamplerWeights(store, policy, engine, timeout_s=30)
    sender = SimpleNamespace(latest_weights=(1, str(store.version_dir(1))))
    return lambda: weights.newest(sender)
