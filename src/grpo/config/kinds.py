"""The names the config may give to things built by the layers above it, each with what the config's rules
need to know about it: rollout engines (``rollout.engine``) and tool-call formats (``rollout.tool_call_format``).

The config sits below ``grpo.rollout`` and ``grpo.multiturn``, so it cannot read their registries; they are
declared here instead, torch-free, and the owners key their implementations by these names:
``grpo.rollout.build.ENGINES`` pairs each ``ENGINE_TRAITS`` entry with how to build it,
``grpo.multiturn.tool_calls.TOOL_CALL_FORMATS`` each ``TOOL_CALL_MARKERS`` entry with its parser
(tests/test_registries.py checks the names agree). The schema's ``choices``, its rules and the docs read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.algorithm.lookup import lookup
from grpo.config.device_defaults import AUTO


@dataclass(frozen=True)
class EngineTraits:
    """What a rollout engine can do, as far as the config's rules and the run's set-up care.

    own_weights: it samples from its own copy of the weights, in its own memory reservation: the trainer pushes
        every new version into it, and its log-probs may differ from the trainer's (so ``rollout.vllm_check_steps``
        and ``loss.sampler_is_correction`` mean something only with it).
    fixed_context: its sequences are sized when it is built (``data.max_prompt_length +
        rollout.max_completion_length``, which must fit the model's context), so a prompt is bounded by that.
    sampling_copy: it samples from a copy of the policy's weights refreshed at every call (bf16 on CUDA, LoRA
        merged), held for the whole run beside the policy (``grpo memory`` counts it).
    in_flight: it can load newer weights between two decode steps and continue its open sequences
        (``decoupled.weight_update: in_flight``, ``grpo.rollout.in_flight``).
    """

    own_weights: bool = False
    fixed_context: bool = False
    sampling_copy: bool = False
    in_flight: bool = False


ENGINE_TRAITS: dict[str, EngineTraits] = {
    "hf": EngineTraits(in_flight=True),  # a lean loop over the model's KV cache
    "hf-static": EngineTraits(sampling_copy=True, in_flight=True),  # static cache, decode step as a CUDA graph
    "hf-generate": EngineTraits(),  # model.generate itself
    "vllm": EngineTraits(own_weights=True, fixed_context=True, in_flight=True),  # the optional vllm extra
}

# ``auto`` picks only engines that sample from the policy itself, with no fixed context; whether the one it picks
# has a sampling copy depends on the device (resolve the name first: ``device_defaults.resolve_engine_name``).
AUTO_ENGINE_TRAITS = EngineTraits()

VLLM_ENGINE = "vllm"  # the engine TRL's use_vllm=True asks for (grpo.api.trl_fields)

# log.report_to's trackers (grpo.run.tracking starts them).
TRACKERS = ("tensorboard", "wandb")

# Tool-call formats by the marker their chat template renders (how ``auto`` recognises one).
TOOL_CALL_MARKERS: dict[str, str] = {"hermes": "<tool_call>"}


def engine_traits(name: str) -> EngineTraits:
    """The traits of ``rollout.engine: name`` (``auto``: ``AUTO_ENGINE_TRAITS``); ValueError listing the known
    names."""
    return AUTO_ENGINE_TRAITS if name == AUTO else lookup(ENGINE_TRAITS, "rollout engine", name)
