"""What a run trains with: its task, the policy, its tokenizer, the prompts and the rewards. ``grpo train``
names them in the config and the run loads them; the Python API (``grpo.api``) hands them over as objects.
Either way the run gets one ``RunInputs``, so both take the same path from here on."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from grpo.config import ConfigError, RunConfig
from grpo.models.architecture import check_architecture
from grpo.models.loading import load_policy, load_tokenizer, policy_dtype, prepare_policy, uses_autocast
from grpo.multiturn.wiring import TurnSpec, turn_spec
from grpo.rewards import build_reward_functions
from grpo.tasks import Task, run_task
from grpo.training.evaluator import eval_sources
from grpo.training.loop import LoopHooks


@dataclass
class GivenInputs:
    """Objects a caller gives instead of config keys; None: load as the config says.

    policy:        a loaded causal LM (``PreTrainedModel`` or peft ``PeftModel``), trained in place (moved to
                   the run's device and dtype; LoRA added when ``model.lora_r > 0`` and it has no adapter yet).
    tokenizer:     its tokenizer (padding side and pad token are set as ``load_tokenizer`` sets them).
    train_set:     ``grpo.data.Example`` records (``data.train`` otherwise); ``eval_set`` likewise (``data.eval``), or
                   named sets ``{name: examples}`` (logged as eval/<name>/...).
    reward_fns:    callables with TRL's reward signature, wrapped (``grpo.rewards.RewardFunction``), and
                   ``reward_weights`` one per function.
    hooks:         the loop's callouts (``grpo.training.loop.LoopHooks``).
    tools, environment_factory, rollout_func: TRL's objects for multi-turn or hooked rollouts
                   (``rollout.tools``/``rollout.environment``/``rollout.rollout_func`` otherwise); the factory
                   may be ``grpo.multiturn.environments.Environments`` built already (their pool is reused).
    optimizer, scheduler: a torch optimizer over ``policy``'s parameters and a ``LambdaLR``-like scheduler over it
                   (stepped once per update), in place of ``optim.*``'s AdamW and schedule (None: built from the
                   config; an optimizer alone gets the config's schedule). Checkpoints hold their states.
    """

    policy: torch.nn.Module | None = None
    tokenizer: object | None = None
    train_set: list | None = None
    eval_set: list | dict[str, list] | None = None
    reward_fns: list | None = None
    reward_weights: list[float] | None = None
    hooks: LoopHooks = field(default_factory=LoopHooks)
    tools: list | None = None
    environment_factory: object | None = None
    rollout_func: object | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object | None = None


@dataclass
class RunInputs:
    """Everything a run trains with, loaded or given (``tokenizer_and_data`` then ``policy_for``)."""

    task: Task  # data.task, resolved once per process: it loads the data and scores the answers
    tokenizer: object
    train_set: list
    eval_sets: dict[str, list]  # {set name: examples}; "" the one unnamed set (grpo.training.evaluator)
    reward_fns: list
    reward_weights: list[float]
    hooks: LoopHooks
    turns: TurnSpec  # tools, environments, a rollout hook (``grpo.multiturn.wiring.with_turns`` wraps the engine)


def load_data(cfg: RunConfig, task: Task) -> tuple[list, dict[str, list]]:
    """(training examples, held-out sets ``{name: examples}``: {} without data.eval, the one unnamed set ""
    for a plain source), read by the run's ``task``."""
    train_set = task.load(cfg.data.train, cfg.data.split, cfg.data.train_limit)
    eval_sets = {name: task.load(source, cfg.data.eval_split, cfg.data.eval_limit)
                 for name, source in eval_sources(cfg.data.eval).items()}
    return train_set, eval_sets


def build_rewards(cfg: RunConfig, examples: Sequence | None = None) -> tuple[list, list[float]]:
    """The configured reward functions and their weights; a reward that cannot be built (unknown
    name, a dotted path that does not import, bad params or factory_args) or, given the training
    ``examples``, cannot take TRL's keyword call with their columns is a configuration error naming it."""
    column_names = list(examples[0].columns()) if examples else None
    if not cfg.rewards:  # allowed by the rules only with rollout.environment: its get_reward (multiturn.setup)
        return [], []
    try:
        functions = build_reward_functions(cfg.rewards, cfg.data.tag_style, column_names)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"rewards: {err}") from None
    except SyntaxError as err:
        # A user's reward module with a syntax error is not an ImportError: without this it left the
        # command with a traceback (exit 1) instead of a configuration error naming the reward.
        names = ", ".join(repr(r.name) for r in cfg.rewards if ":" in r.name)
        raise ConfigError(f"rewards: reward {names} does not import: {err.filename}:{err.lineno}: "
                          f"SyntaxError: {err.msg}") from None
    return functions, [r.weight for r in cfg.rewards]


def run_tokenizer(cfg: RunConfig, given: GivenInputs):
    """The given tokenizer set up as ``load_tokenizer``'s (a copy when that changes it), else the model's."""
    tokenizer = given.tokenizer or load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    if given.tokenizer is not None and (tokenizer.padding_side != "left" or tokenizer.pad_token is None):
        tokenizer = copy.deepcopy(tokenizer)  # set up as load_tokenizer's, leaving the caller's object as it was
        tokenizer.padding_side = "left"  # batched generation pads prompts on the left
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_and_data(cfg: RunConfig, given: GivenInputs, *, data: bool = True) -> RunInputs:
    """The run's task (resolved here, once), tokenizer, data and rewards: given ones as they are, the rest
    loaded from the config. A broken reward stops the run here, before any model loads. ``data`` False: the
    task and tokenizer only (a decoupled trainer that evaluates nothing: its samplers load and score the
    prompts)."""
    task = run_task(cfg)
    tokenizer = run_tokenizer(cfg, given)
    if not data:
        return RunInputs(task, tokenizer, [], {}, [], [], given.hooks, TurnSpec())
    if given.train_set is not None:
        train_set = given.train_set
        given_sets = given.eval_set or {}
        eval_sets = dict(given_sets) if isinstance(given_sets, dict) else {"": list(given_sets)}
    else:
        train_set, eval_sets = load_data(cfg, task)
    if given.reward_fns is not None:
        reward_fns, reward_weights = given.reward_fns, list(given.reward_weights or [1.0] * len(given.reward_fns))
    else:
        reward_fns, reward_weights = build_rewards(cfg, train_set)
    turns = turn_spec(cfg, given.tools, given.environment_factory, given.rollout_func)
    reward_fns, reward_weights = turns.with_environment_rewards(reward_fns, reward_weights)
    return RunInputs(task, tokenizer, train_set, eval_sets, reward_fns, reward_weights, given.hooks, turns)


def policy_for(cfg: RunConfig, given: GivenInputs, device: torch.device, deepspeed: bool) -> torch.nn.Module:
    """The trainable policy on ``device``: the given model made ready in place, or ``model.name_or_path``
    loaded (fp32 master weights when the compute runs under bf16 autocast, as ``load_policy``)."""
    master_weights = uses_autocast(cfg.model, deepspeed)
    if given.policy is None:
        policy = load_policy(cfg.model, device, master_weights=master_weights)
    else:
        dtype = torch.float32 if master_weights else policy_dtype(cfg.model)
        policy = prepare_policy(given.policy, cfg.model, device, dtype)
    check_architecture(cfg, policy)  # what the family cannot do: refused before the run writes anything
    return policy
