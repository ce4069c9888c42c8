"""Every registry of names against every place that names its entries: the schema's choices, the keys' help
(the config-key table of docs/reference/config.md), the engines' and tool-call formats' declarations in ``grpo.config.kinds`` and
their implementations above it, the Python API's checks and the TRL mapping."""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass

import pytest

from grpo.algorithm import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SAMPLER_CORRECTIONS,
)
from grpo.algorithm.schedules import LR_SCHEDULES
from grpo.api import mapping, trl_fields
from grpo.api.arguments import GRPOConfig
from grpo.config import RunConfig, iter_config_keys, load_config
from grpo.config.device_defaults import AUTO, resolve_engine_name
from grpo.config.kinds import ENGINE_TRAITS, TOOL_CALL_MARKERS, TRACKERS, VLLM_ENGINE, engine_traits
from grpo.data.sft import RESPONSE_FORMATS
from grpo.data.tags import TAG_STYLES
from grpo.multiturn.tool_calls import TOOL_CALL_FORMATS
from grpo.rollout.build import ENGINES
from grpo.run import tracking
from grpo.tasks.builtin_tasks import BUILTIN_TASKS

# config key -> (the registry its values name, the values allowed beside the registry's names)
KEYED = {
    "algorithm.advantage_estimator": (ADVANTAGE_ESTIMATORS, ()),
    "algorithm.multi_objective_aggregation": (MULTI_OBJECTIVE_AGGREGATIONS, ()),
    "loss.loss_type": (LOSS_TYPES, ()),
    "loss.scale_rewards": (ADVANTAGE_SCALES, (None,)),
    "loss.importance_sampling_level": (IMPORTANCE_SAMPLING_LEVELS, ()),
    "loss.sampler_is_mode": (SAMPLER_CORRECTIONS, ()),
    "data.tag_style": (TAG_STYLES, ()),
    "ptx.response_format": (RESPONSE_FORMATS, ()),
    "optim.lr_scheduler_type": (LR_SCHEDULES, ()),
    "critic.lr_scheduler_type": (LR_SCHEDULES, ()),
    "rollout.engine": (ENGINES, (AUTO,)),
    "rollout.tool_call_format": (TOOL_CALL_FORMATS, (AUTO,)),
}


def _fields(cls=RunConfig, prefix=""):
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            yield from _fields(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


FIELDS = dict(_fields())
HELP = {key: help_text for key, _, _, help_text in iter_config_keys()}
SHOWN = {key: shown for key, shown, _, _ in iter_config_keys()}


def _names_word(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


@pytest.mark.parametrize("key", sorted(KEYED))
def test_the_schema_allows_exactly_the_registered_names_and_documents_each(key):
    registry, extra = KEYED[key]
    assert FIELDS[key].metadata["choices"] == (*extra, *registry)
    for name in registry:  # the prose of the help (the docs' config-key table) names every entry, as a word
        assert _names_word(HELP[key], name), (key, name)
    assert SHOWN[key] == "one of " + ", ".join("null" if c is None else c for c in (*extra, *registry))


# Keys whose few values pick a branch where they are read, not an entry of a registry (dtypes and compile modes:
# torch's names).
SWITCHES = {"algorithm.kl_penalty", "train.mode", "train.best_metric_mode", "train.checkpoint_layout",
            "train.save_strategy", "train.eval_strategy", "log.logging_strategy",
            "decoupled.weight_sync", "decoupled.weight_update", "optim.optimizer", "model.ref_torch_dtype", "rollout.vllm_dtype",
            "fsdp.reduce_dtype", "train.torch_compile_mode"}


def test_every_key_with_choices_reads_a_registry_or_is_a_listed_switch():
    assert {key for key, f in FIELDS.items() if f.metadata.get("choices")} == set(KEYED) | SWITCHES


def test_the_tasks_key_names_every_builtin_task():  # data.task takes a dotted path too, so it has no choices
    assert all(_names_word(HELP["data.task"], name) for name in BUILTIN_TASKS)
    assert all(_names_word(HELP["log.report_to"], name) for name in TRACKERS)


def test_a_name_outside_a_registry_is_refused_at_load_naming_the_key():
    for key in KEYED:
        with pytest.raises(Exception, match=re.escape(key)):
            load_config(None, [f"{key}=not-a-registered-name"])


def test_upper_layers_implement_exactly_the_names_declared_below_them():
    assert list(ENGINES) == list(ENGINE_TRAITS)
    assert all(ENGINES[name].traits is ENGINE_TRAITS[name] for name in ENGINES)
    assert list(TOOL_CALL_FORMATS) == list(TOOL_CALL_MARKERS)
    assert tracking.KNOWN_TRACKERS is TRACKERS and mapping.TRACKERS is TRACKERS
    # auto resolves to a registered engine on every device, and only to one sampling from the policy itself
    for device in ("cpu", "cuda", "mps"):
        for quantized in (False, True):
            name = resolve_engine_name(AUTO, device, quantized=quantized)
            assert name in ENGINES and not ENGINE_TRAITS[name].own_weights
    assert not engine_traits(AUTO).own_weights and not engine_traits(AUTO).fixed_context
    with pytest.raises(ValueError, match=r"unknown rollout engine 'nope'; known: \[.*'vllm'"):
        engine_traits("nope")


def test_the_python_api_accepts_exactly_the_registered_names():
    for name in LOSS_TYPES:
        epsilon_high = {"epsilon_high": 5.0} if name == "cispo" else {}  # cispo's cap (refused without one)
        args = GRPOConfig(loss_type=name, use_cpu=True, max_steps=1, **epsilon_high)
        assert args.to_run_config().loss.loss_type == name
    with pytest.raises(ValueError, match="loss_type='ppo'.*" + ", ".join(LOSS_TYPES)):
        GRPOConfig(loss_type="ppo")
    # TRL's scale_rewards strings are the advantage scales (group: grpo's null default)
    for name in ADVANTAGE_SCALES:
        scale = GRPOConfig(scale_rewards=name, loss_type="grpo", use_cpu=True, max_steps=1).to_run_config().loss.scale_rewards
        assert scale == (None if name == "group" else name)
    with pytest.raises(ValueError, match="scale_rewards='std': one of " + ", ".join(ADVANTAGE_SCALES)):
        GRPOConfig(scale_rewards="std", use_cpu=True, max_steps=1).to_run_config()
    assert set(trl_fields.SCHEDULES.values()) == set(LR_SCHEDULES)  # TRL's schedules onto ours, each of ours reached
    # TRL's use_vllm is the engine with its own weights and a context fixed when built, both ways
    assert [n for n, t in ENGINE_TRAITS.items() if t.own_weights or t.fixed_context] == [VLLM_ENGINE]
    cfg = GRPOConfig(use_vllm=True, use_cpu=True, max_steps=1).to_run_config()
    assert cfg.rollout.engine == VLLM_ENGINE and GRPOConfig.from_run_config(cfg).use_vllm
