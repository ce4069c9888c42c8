"""One step's experience: prompts -> group of completions -> rewards -> advantages -> old/ref log-probs.

This is the sampler's half of GRPO (the same function serves the colocated loop and, later, the
sampler process). No optimisation and no logging here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from grpo.algorithm import LogprobProcessing, group_advantages
from grpo.data import DataError, Example, build_prompt_messages, render_prompt
from grpo.logprobs import completion_logprobs
from grpo.models import reference_context
from grpo.records import Generation, RolloutBatch
from grpo.rewards import answers_equal, extract_answer, is_well_formatted, score
from grpo.rewards.context import RewardContext, make_trainer_state
from grpo.rollout import RolloutEngine, SamplingParams


@dataclass(frozen=True)
class GaeSettings:
    """PPO's advantages (algorithm.advantage_estimator gae): GAE over a critic's values."""

    gamma: float
    lam: float
    kl_coef: float  # loss.beta when the KL penalty is in the reward (algorithm.kl_penalty: reward), else 0


@dataclass(frozen=True)
class ExperienceSettings:
    """The inputs of a rollout step that come from the config (kept explicit, not the whole tree)."""

    sampling: SamplingParams
    system_prompt: str | None
    tag_style: str
    max_prompt_length: int
    advantage_estimator: str  # a name in grpo.algorithm.ADVANTAGE_ESTIMATORS, or "gae" (PPO: then ``gae`` is set)
    scale_rewards: str | None  # the grpo estimator's scaling; None for its default (group) and the others
    advantage_eps: float
    need_old_logprobs: bool  # num_iterations > 1
    logprob_batch_size: int
    max_steps: int = 0  # the run's length, for the rewards' trainer_state
    processing: LogprobProcessing | None = None  # the sampling controls the old log-probs follow (None: off)
    gae: GaeSettings | None = None  # set: token-level advantages from the critic's values (make_experience's values_fn)


def render_prompts(tokenizer, examples: Sequence[Example], system_prompt: str | None,
                   max_prompt_length: int) -> list[str]:
    """Chat-template each example; a prompt over ``max_prompt_length`` tokens is an error naming it."""
    prompts = []
    for example in examples:
        text = render_prompt(tokenizer, build_prompt_messages(example, system_prompt))
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length > max_prompt_length:
            raise DataError(f"{example.source}: prompt is {length} tokens, over data.max_prompt_length "
                            f"{max_prompt_length}; raise it or drop the example")
        prompts.append(text)
    return prompts


def correctness(completions: Sequence[str], golds: Sequence[str | None],
                tag_style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] bool answer correct, [N] bool well formatted) for logging accuracy and format rate;
    ``golds`` has one gold answer (or None) per completion."""
    correct = [gold is not None and answers_equal(extract_answer(c, tag_style), gold)
               for c, gold in zip(completions, golds)]
    formatted = [is_well_formatted(c, tag_style) for c in completions]
    return torch.tensor(correct), torch.tensor(formatted)


RefLogprobs = Callable[[Generation], torch.Tensor]  # [N, Lc] reference log-probs of a generation
Values = Callable[[Generation], torch.Tensor]  # [N, Lc] a critic's values of a generation's states


def local_reference(policy: torch.nn.Module, reference: torch.nn.Module | None, temperature: float,
                    batch_size: int, processing: LogprobProcessing | None = None) -> RefLogprobs:
    """Reference log-probs from a model in this process (or the LoRA policy with its adapter off), of the
    same processed distribution as the policy's (``processing``), so the KL compares like with like."""
    def ref_logprobs(generation: Generation) -> torch.Tensor:
        with reference_context(policy, reference) as ref_model:
            return generation_logprobs(ref_model, generation, temperature, batch_size, processing)
    return ref_logprobs


def generation_logprobs(model: torch.nn.Module, generation: Generation, temperature: float,
                        batch_size: int, processing: LogprobProcessing | None = None) -> torch.Tensor:
    """[N, Lc] log-probs of a generation's completion tokens under ``model``, without gradients (of the
    distribution the sampling controls in ``processing`` define; None: the tempered logits)."""
    with torch.no_grad():
        return completion_logprobs(model, generation.prompt_ids, generation.prompt_mask,
                                   generation.completion_ids, generation.completion_mask, temperature, batch_size,
                                   processing=processing)


def make_experience(
    engine: RolloutEngine,
    policy: torch.nn.Module,
    ref_logprobs_fn: RefLogprobs | None,
    tokenizer,
    examples: Sequence[Example],
    reward_fns: Sequence,
    reward_weights: Sequence[float],
    settings: ExperienceSettings,
    seed: int,
    steps_done: int = 0,
    values_fn: Values | None = None,
) -> RolloutBatch:
    """Sample ``G`` completions per example with the current policy and turn them into a ``RolloutBatch``.

    ``ref_logprobs_fn`` is None when beta == 0 (no reference needed). ``steps_done`` (training steps
    finished before this one) is the rewards' ``trainer_state.global_step``. With ``settings.gae`` the
    critic's ``values_fn`` gives the values after sampling and the advantages are PPO's, per token
    (``grpo.critic.ppo_advantages``); with a KL coefficient there, ``old_logprobs`` must be computed
    (``need_old_logprobs``) for the per-token KL ``logp_old - logp_ref``."""
    if (settings.gae is None) != (values_fn is None):
        raise ValueError("make_experience: settings.gae and values_fn go together (PPO's critic), got "
                         f"gae={settings.gae} and values_fn={values_fn}")
    if settings.gae is not None and settings.gae.kl_coef and not (settings.need_old_logprobs and ref_logprobs_fn):
        raise ValueError("make_experience: a KL penalty in the reward needs old and reference log-probs "
                         "(need_old_logprobs and ref_logprobs_fn)")
    G = settings.sampling.n
    started = time.perf_counter()
    prompts = render_prompts(tokenizer, examples, settings.system_prompt, settings.max_prompt_length)
    generation = engine.generate(prompts, settings.sampling, seed=seed)
    generated = time.perf_counter()

    # Rewards see chat-format prompts and completions, as TRL passes them for conversational data,
    # so TRL reward functions (which read completion[0]["content"]) run unchanged; completion_ids are
    # each completion's tokens up to and including EOS, as TRL's completion_ids_list.
    chat_prompts = [build_prompt_messages(e, settings.system_prompt) for e in examples for _ in range(G)]
    chat_completions = [[{"role": "assistant", "content": text}] for text in generation.completions]
    completion_ids = [ids[mask.bool()].tolist()
                      for ids, mask in zip(generation.completion_ids, generation.completion_mask)]
    columns: dict[str, list] = {}
    for e in examples:
        for key, value in e.columns().items():
            columns.setdefault(key, []).extend([value] * G)
    context = RewardContext(make_trainer_state(steps_done, settings.max_steps))
    scores = score(reward_fns, reward_weights, chat_prompts, chat_completions, columns, completion_ids, context)
    if settings.gae is None:
        advantages = group_advantages(scores.total, G, scale=settings.scale_rewards, eps=settings.advantage_eps,
                                      estimator=settings.advantage_estimator)
    scored = time.perf_counter()

    old_logprobs = None
    if settings.need_old_logprobs:
        old_logprobs = generation_logprobs(policy, generation, settings.sampling.temperature,
                                           settings.logprob_batch_size, settings.processing)
    ref_logprobs = ref_logprobs_fn(generation) if ref_logprobs_fn is not None else None
    values = returns = None
    if settings.gae is not None:
        advantages, values, returns = _ppo_advantages(scores.total, generation, values_fn, old_logprobs,
                                                      ref_logprobs, settings.gae)
    return RolloutBatch(
        generation=generation,
        rewards=scores.total,
        reward_parts=scores.per_function,
        reward_names=scores.names,
        advantages=advantages,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        prompts=prompts,
        columns=columns,
        reward_metrics=context.metric_means(),
        reward_extras=context.extra_columns(len(generation.completions)),
        timings={"generate_s": generated - started, "rewards_s": scored - generated,
                 "logprobs_s": time.perf_counter() - scored},
        values=values,
        returns=returns,
    )


def _ppo_advantages(rewards: torch.Tensor, generation: Generation, values_fn: Values,
                    old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                    gae: GaeSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([N, Lc] whitened advantages, [N, Lc] values, [N, Lc] returns), on the CPU like the rollout's tensors."""
    from grpo.critic.advantages import ppo_advantages

    mask = generation.completion_mask
    values = values_fn(generation).float().cpu()  # [N, Lc]
    kl = (old_logprobs.cpu() - ref_logprobs.cpu()) if gae.kl_coef else None  # [N, Lc]: k1, PPO's per-token KL
    advantages, returns = ppo_advantages(rewards.float(), values, mask, gamma=gae.gamma, lam=gae.lam, kl=kl,
                                         kl_coef=gae.kl_coef)
    return advantages, values, returns
