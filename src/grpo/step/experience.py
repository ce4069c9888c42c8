"""One step's experience: prompts -> group of completions -> rewards -> advantages -> old/ref log-probs.

This is the sampler's half of GRPO: ``rank_experience`` makes one rank's batch for a step, in the
colocated loop and in the decoupled sampler (one chunk per trainer rank). It samples and scores
(``sample_and_score``; with dynamic sampling several rounds, merged by ``grpo.step.dynamic_sampling``), then
adds advantages and log-probs once, to the final batch (``finish_experience``). No optimisation and no
logging here.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from grpo.algorithm import LogprobProcessing, group_advantages, multi_reward_advantages
from grpo.algorithm.ppo import ppo_advantages
from grpo.data import Example, PromptTooLong, build_prompt_messages, render_example
from grpo.data.prompt_sampler import PromptSampler, step_seed
from grpo.models.loading import reference_context
from grpo.models.routing_replay import Replaying
from grpo.multiturn.driver import ExampleRollout
from grpo.rewards import score
from grpo.rewards.context import RewardContext, make_trainer_state
from grpo.rollout import RolloutEngine, SamplingParams
from grpo.rollout.generation import Generation
from grpo.step.dynamic_sampling import sample_until_full
from grpo.step.logprob_pass import DEVICE_DEFAULT_PASS, LogprobPass
from grpo.step.logprobs import completion_logprobs
from grpo.step.records import RolloutBatch


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
    max_prompt_length: int
    advantage_estimator: str  # a name in grpo.algorithm.ADVANTAGE_ESTIMATORS, or "gae" (PPO: then ``gae`` is set)
    scale_rewards: str | None  # the grpo estimator's scaling; None for its default (group) and the others
    advantage_eps: float
    need_old_logprobs: bool  # computed after sampling: grpo.training.settings.old_logprobs_after_sampling
    logprob_batch_size: int
    max_steps: int = 0  # the run's length, for the rewards' trainer_state
    processing: LogprobProcessing | None = None  # the sampling controls the old log-probs follow (None: off)
    logprob_pass: LogprobPass = DEVICE_DEFAULT_PASS  # how the old log-prob pass runs (None fields: the device's default)
    routing_replay: bool = False  # loss.routing_replay: the old log-prob pass routes to the rollout's experts
    gae: GaeSettings | None = None  # set: token-level advantages from the critic's values (rank_experience's values_fn)
    # several rewards: "sum_then_normalize" (the estimator on the weighted total) or "normalize_then_sum" (GDPO)
    multi_objective_aggregation: str = "sum_then_normalize"


def render_prompts(tokenizer, examples: Sequence[Example], system_prompt: str | None,
                   max_prompt_length: int) -> list[str]:
    """Chat-template each example; a prompt over ``max_prompt_length`` tokens is an error naming it."""
    prompts = []
    for example in examples:
        text = render_example(tokenizer, example, system_prompt)
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length > max_prompt_length:
            raise PromptTooLong(example.source, length, max_prompt_length)
        prompts.append(text)
    return prompts


RefLogprobs = Callable[[Generation], torch.Tensor]  # [N, Lc] reference log-probs of a generation
Values = Callable[[Generation], torch.Tensor]  # [N, Lc] a critic's values of a generation's states


def local_reference(policy: torch.nn.Module, reference: torch.nn.Module | None, temperature: float,
                    batch_size: int, processing: LogprobProcessing | None = None,
                    logprob_pass: LogprobPass = DEVICE_DEFAULT_PASS) -> RefLogprobs:
    """Reference log-probs from a model in this process (or the LoRA policy with its adapter off), of the
    same processed distribution as the policy's (``processing``), so the KL compares like with like."""
    def ref_logprobs(generation: Generation) -> torch.Tensor:
        with reference_context(policy, reference) as ref_model:
            return generation_logprobs(ref_model, generation, temperature, batch_size, processing, logprob_pass)
    return ref_logprobs


def generation_logprobs(model: torch.nn.Module, generation: Generation, temperature: float,
                        batch_size: int, processing: LogprobProcessing | None = None,
                        logprob_pass: LogprobPass = DEVICE_DEFAULT_PASS, replay_routing: bool = False) -> torch.Tensor:
    """[N, Lc] log-probs of a generation's completion tokens under ``model``, without gradients (of the
    distribution the sampling controls in ``processing`` define; None: the tempered logits), the pass run
    as ``logprob_pass`` says; ``replay_routing``: routed to the generation's recorded experts (the policy's
    old log-probs under ``loss.routing_replay``)."""
    replaying = Replaying(model) if replay_routing and generation.routing is not None else None
    with torch.no_grad(), replaying.hooks() if replaying is not None else nullcontext():
        return completion_logprobs(model, generation.prompt_ids, generation.prompt_mask,
                                   generation.completion_ids, generation.completion_mask, temperature, batch_size,
                                   share_prompts=logprob_pass.share_prompts,
                                   column_bucket=logprob_pass.column_bucket, processing=processing,
                                   fused_head=logprob_pass.fused_head, pack=logprob_pass.pack,
                                   routing=generation.routing, replaying=replaying)


def rank_experience(
    engine: RolloutEngine,
    policy: torch.nn.Module,
    ref_logprobs_fn: RefLogprobs | None,
    tokenizer,
    train_set: Sequence[Example],
    prompt_sampler: PromptSampler,
    reward_fns: Sequence,
    reward_weights: Sequence[float],
    settings: ExperienceSettings,
    *,
    step: int,
    rank: int,
    world_size: int,
    seed: int,
    max_rounds: int | None = None,
    values_fn: Values | None = None,
) -> tuple[RolloutBatch, dict[str, float]]:
    """Rank ``rank``'s batch for ``step``: its prompts (``prompt_sampler.rank_indices``) sampled with its
    seed (``step_seed`` of the run's ``seed``), scored and finished (``sample_and_score``,
    ``finish_experience``); the second value is the rank's dynamic-sampling counts (empty without it).

    ``ref_logprobs_fn`` is None when beta == 0 (no reference needed). With ``settings.gae`` the critic's
    ``values_fn`` gives the values after sampling and the advantages are PPO's, per token
    (``grpo.algorithm.ppo.ppo_advantages``); with a KL coefficient there, ``old_logprobs`` must be computed
    (``need_old_logprobs``) for the per-token KL ``logp_old - logp_ref``.

    With ``max_rounds`` (dynamic sampling, ``grpo.step.dynamic_sampling``) zero-spread groups are dropped and
    rounds of further prompts (``prompt_sampler.extra_indices``) sampled, each round's prompts and seed a function
    of (seed, step, rank, round), counted by ``sample_until_full``. Every
    round's rewards see ``trainer_state.global_step = step - 1``: they score the same training step."""
    check_experience_inputs(settings, ref_logprobs_fn, values_fn)

    def draw(round_index: int) -> RolloutBatch:
        indices = (prompt_sampler.rank_indices(step, rank, world_size) if round_index == 0
                   else prompt_sampler.extra_indices(step, rank, world_size, round_index))
        return sample_and_score(engine, tokenizer, [train_set[i] for i in indices], reward_fns, reward_weights,
                                settings, seed=step_seed(seed, step, rank, round_index), steps_done=step - 1)

    if max_rounds is None:
        scored, stats = draw(0), {}
    else:
        want = len(prompt_sampler.rank_indices(step, rank, world_size))
        scored, stats = sample_until_full(draw, want, max_rounds, tokenizer.pad_token_id)
    return finish_experience(scored, policy, ref_logprobs_fn, settings, values_fn), stats


def check_experience_inputs(settings: ExperienceSettings, ref_logprobs_fn: RefLogprobs | None,
                            values_fn: Values | None) -> None:
    """ValueError when the settings and the functions given for them do not go together."""
    if (settings.gae is None) != (values_fn is None):
        raise ValueError("rank_experience: settings.gae and values_fn go together (PPO's critic), got "
                         f"gae={settings.gae} and values_fn={values_fn}")
    if settings.gae is not None and settings.gae.kl_coef and not (settings.need_old_logprobs and ref_logprobs_fn):
        raise ValueError("rank_experience: a KL penalty in the reward needs old and reference log-probs "
                         "(need_old_logprobs and ref_logprobs_fn)")


def sample_and_score(engine: RolloutEngine, tokenizer, examples: Sequence[Example], reward_fns: Sequence,
                     reward_weights: Sequence[float], settings: ExperienceSettings, seed: int,
                     steps_done: int = 0) -> RolloutBatch:
    """Generate ``G`` completions per example and score them: a ``RolloutBatch`` whose advantages are
    still 0 and which has no log-probs yet (``finish_experience`` adds both, once the batch is final:
    dynamic sampling keeps only some groups of several of these, and the batch-statistics estimators
    must see the batch that is trained). ``sampler_logprobs`` are the generation's, when the engine
    reports them (vLLM, or a test's fake)."""
    G = settings.sampling.n
    started = time.perf_counter()
    reward_only: dict[str, list] = {}  # per-row keywords for the rewards that are not dataset columns
    if isinstance(engine, ExampleRollout):  # tools, environments or a rollout hook (grpo.multiturn)
        turns = engine.rollout(examples, settings.system_prompt, settings.max_prompt_length, settings.sampling, seed)
        prompts, generation, chat_prompts = turns.prompts, turns.generation, turns.chat_prompts
        if turns.environments is not None:
            reward_only["environments"] = turns.environments
        reward_only.update(getattr(engine, "extra_columns", {}))  # a hook's extra outputs, as TRL passes them
    else:
        prompts = render_prompts(tokenizer, examples, settings.system_prompt, settings.max_prompt_length)
        generation = engine.generate(prompts, settings.sampling, seed=seed)
        # Rewards see chat-format prompts and completions, as TRL passes them for conversational data,
        # so TRL reward functions (which read completion[0]["content"]) run unchanged.
        # Plain-text prompts (the Python API's, as TRL's) give the rewards strings instead.
        chat_prompts = [e.question if e.plain_text else build_prompt_messages(e, settings.system_prompt)
                        for e in examples for _ in range(G)]
    return score_generation(examples, prompts, generation, chat_prompts, reward_only, reward_fns, reward_weights,
                            settings, steps_done, generate_s=time.perf_counter() - started)


def score_generation(examples: Sequence[Example], prompts: list[str], generation: Generation, chat_prompts: list,
                     reward_only: dict[str, list], reward_fns: Sequence, reward_weights: Sequence[float],
                     settings: ExperienceSettings, steps_done: int, generate_s: float) -> RolloutBatch:
    """``sample_and_score``'s second half: the rewards of a generation (G rows per example, in order) and the
    ``RolloutBatch`` they make (``reward_only``: per-row keywords for the rewards that are not dataset columns;
    ``generate_s``: how long the generation took, for the timings)."""
    G = settings.sampling.n
    generated = time.perf_counter()

    # A multi-turn completion is its messages (assistant turns with tool_calls, tool results), as TRL passes it;
    # completion_ids are each completion's tokens up to and including EOS (the tool results' too, as TRL's).
    if generation.messages is not None:
        chat_completions = generation.messages
    else:
        chat_completions = [text if examples[i // G].plain_text else [{"role": "assistant", "content": text}]
                            for i, text in enumerate(generation.completions)]
    completion_ids = [ids[mask.bool()].tolist()
                      for ids, mask in zip(generation.completion_ids, generation.completion_mask)]
    columns: dict[str, list] = {}
    for e in examples:
        for key, value in e.columns().items():
            columns.setdefault(key, []).extend([value] * G)
    context = RewardContext(make_trainer_state(steps_done, settings.max_steps))
    scores = score(reward_fns, reward_weights, chat_prompts, chat_completions, {**columns, **reward_only},
                   completion_ids, context)
    return RolloutBatch(
        generation=generation,
        rewards=scores.total,
        reward_parts=scores.per_function,
        reward_names=scores.names,
        reward_weights=[float(w) for w in reward_weights],
        advantages=torch.zeros_like(scores.total),  # finish_experience's
        old_logprobs=None,
        ref_logprobs=None,
        prompts=prompts,
        columns=columns,
        reward_metrics=context.metric_means(),
        reward_extras=context.extra_columns(len(generation.completions)),
        chat_prompts=list(chat_prompts),
        chat_completions=list(chat_completions),
        timings={"generate_s": generate_s, "rewards_s": time.perf_counter() - generated},
        sampler_logprobs=generation.sampler_logprobs,
    )


def finish_experience(scored: RolloutBatch, policy: torch.nn.Module, ref_logprobs_fn: RefLogprobs | None,
                      settings: ExperienceSettings, values_fn: Values | None = None) -> RolloutBatch:
    """A scored batch (``sample_and_score``, or several merged) made ready for the loss: its advantages
    (per group, or PPO's per token), old log-probs when ``settings.need_old_logprobs``, reference
    log-probs when ``ref_logprobs_fn`` is given, and the critic's values and returns with ``settings.gae``."""
    started = time.perf_counter()
    generation = scored.generation
    if settings.gae is None and settings.multi_objective_aggregation == "normalize_then_sum":
        advantages = multi_reward_advantages(scored.reward_parts, settings.sampling.n,
                                             torch.tensor(scored.reward_weights, dtype=scored.reward_parts.dtype),
                                             "normalize_then_sum", eps=settings.advantage_eps)
    elif settings.gae is None:
        advantages = group_advantages(scored.rewards, settings.sampling.n, scale=settings.scale_rewards,
                                      eps=settings.advantage_eps, estimator=settings.advantage_estimator)
    old_logprobs = None
    if settings.need_old_logprobs:
        old_logprobs = generation_logprobs(policy, generation, settings.sampling.temperature,
                                           settings.logprob_batch_size, settings.processing, settings.logprob_pass,
                                           replay_routing=settings.routing_replay)
    ref_logprobs = ref_logprobs_fn(generation) if ref_logprobs_fn is not None else None
    values = returns = None
    if settings.gae is not None:
        advantages, values, returns = _ppo_advantages(scored.rewards, generation, values_fn, old_logprobs,
                                                      ref_logprobs, settings.gae)
    return replace(scored, advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                   values=values, returns=returns,
                   timings={**scored.timings, "logprobs_s": time.perf_counter() - started})


def _ppo_advantages(rewards: torch.Tensor, generation: Generation, values_fn: Values,
                    old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                    gae: GaeSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([N, Lc] whitened advantages, [N, Lc] values, [N, Lc] returns), on the CPU like the rollout's tensors."""
    # The critic's values come from a pass over every completion token (environment tokens are context);
    # the actions, the rewards' chain and the whitening are the sampled tokens' (grpo.algorithm.ppo).
    mask = generation.sampled_mask  # [N, Lc]
    values = values_fn(generation).float().cpu()  # [N, Lc]
    kl = (old_logprobs.cpu() - ref_logprobs.cpu()) if gae.kl_coef else None  # [N, Lc]: k1, PPO's per-token KL
    advantages, returns = ppo_advantages(rewards.float(), values, mask, gamma=gae.gamma, lam=gae.lam, kl=kl,
                                         kl_coef=gae.kl_coef)
    return advantages, values, returns
