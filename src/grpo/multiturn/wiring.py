"""What a run's rollouts act with: tools, an environment factory, a rollout hook or a verifiers environment,
named in the config (``rollout.tools``, ``rollout.environment``, ``rollout.rollout_func``, ``data.train:
verifiers:...``) or given as objects (the Python API's ``tools=``, ``environment_factory=``, ``rollout_func=``,
a verifiers environment as ``train_dataset``); and the engine wrapped to use them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from grpo.config import ConfigError
from grpo.models.wrappers import eos_token_ids, unwrap_model
from grpo.multiturn.driver import MultiTurnRollout
from grpo.multiturn.environments import Environments
from grpo.multiturn.rollout_hook import RolloutHook
from grpo.multiturn.tools import load_callable
from grpo.multiturn.verifiers_rollout import VerifiersRollout, reward_functions
from grpo.rewards import RewardFunction
from grpo.rollout.generate_endpoint import policy_logprobs


@dataclass
class TurnSpec:
    """The resolved objects; ``active`` when any is set (the run then makes multi-turn or hooked rollouts)."""

    tools: list[Callable] = field(default_factory=list)
    environments: Environments | None = None
    rollout_func: Callable | None = None
    verifiers: str | None = None  # a ``verifiers:`` data source: its environment plays the episodes

    @property
    def active(self) -> bool:
        return (bool(self.tools) or self.environments is not None or self.rollout_func is not None
                or self.verifiers is not None)

    def with_environment_rewards(self, reward_fns: list, reward_weights: list[float]) -> tuple[list, list[float]]:
        """The run's rewards plus each environment class's ``get_reward`` (weight 1, named after the class, as TRL)."""
        extra = [RewardFunction(fn) for fn in self.environments.reward_functions()] if self.environments else []
        if self.verifiers is not None:  # the verifiers tasks' rewards, with their own weights
            functions, weights = reward_functions(self.verifiers)
            return [*reward_fns, *map(RewardFunction, functions)], [*reward_weights, *weights]
        if not reward_fns and not extra:
            raise ConfigError("rewards: none given, and the environment's classes define no get_reward; "
                              "name a reward function (rewards / reward_funcs) or give the environment get_reward()")
        return [*reward_fns, *extra], [*reward_weights, *[1.0] * len(extra)]


def turn_spec(cfg, tools: list | None = None, environment_factory: Any = None,
              rollout_func: Callable | None = None) -> TurnSpec:
    """Given objects win over config names; a name that does not import is a ConfigError naming the key.
    ``environment_factory`` may be ``Environments`` built already (the Python API builds them once, as TRL)."""
    r = cfg.rollout
    try:
        if tools is None:
            tools = [load_callable(spec, f"rollout.tools[{i}]") for i, spec in enumerate(r.tools)]
        if environment_factory is None and r.environment:
            environment_factory = load_callable(r.environment, "rollout.environment")
        if rollout_func is None and r.rollout_func:
            rollout_func = load_callable(r.rollout_func, "rollout.rollout_func")
        environments = (environment_factory if isinstance(environment_factory, Environments) or environment_factory
                        is None else Environments(environment_factory))  # built: the caller's, its pool reused
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if rollout_func is not None and (tools or environments is not None):
        raise ConfigError("rollout.rollout_func makes the rollouts itself: it cannot be combined with rollout.tools "
                          "or rollout.environment (run your tools inside it)")
    verifiers = cfg.data.train if str(cfg.data.train).startswith("verifiers:") else None
    if verifiers is not None and (tools or environments is not None or rollout_func is not None):
        raise ConfigError("data.train is a verifiers environment, whose harness plays the episodes: it cannot be "
                          "combined with rollout.tools, rollout.environment or rollout.rollout_func")
    for tool in tools:
        if not callable(tool):
            raise ConfigError(f"tools: {tool!r} is not callable")
    return TurnSpec(list(tools), environments, rollout_func, verifiers)


def with_turns(engine, spec: TurnSpec, cfg, policy, tokenizer):
    """The run's engine, wrapped for tools/environments (``MultiTurnRollout``) or a hook (``RolloutHook``);
    the engine itself when ``spec`` is not active. A chat template or tool that cannot work is a ConfigError."""
    if not spec.active:
        return engine

    eos_ids = eos_token_ids(unwrap_model(policy), tokenizer)
    if spec.rollout_func is not None:
        return RolloutHook(spec.rollout_func, engine, tokenizer, eos_ids)
    r = cfg.rollout
    if spec.verifiers is not None:
        return VerifiersRollout(engine, tokenizer, eos_ids, spec.verifiers,
                                policy_logprobs(unwrap_model(policy), r.temperature),
                                tokenizer.name_or_path or cfg.model.name_or_path,
                                cfg.data.max_prompt_length + r.max_completion_length)
    try:
        return MultiTurnRollout(engine, tokenizer, eos_ids, spec.tools, spec.environments,
                                r.max_tool_calling_iterations, r.tool_timeout_s, r.tool_call_format)
    except ValueError as err:
        raise ConfigError(f"rollout.tools: {err}") from None
