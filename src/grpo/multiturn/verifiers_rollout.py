"""Rollouts played by a verifiers environment's harness against grpo's generate endpoint.

For a step's examples (one per task of the environment's taskset, ``grpo.data.verifiers_env``) each task is
played ``G`` times (a group) by the environment (``vf.Env.run_slot``: its harness, its task's rewards),
concurrently, at most ``concurrency`` episodes at once, each within ``timeout_s`` (the source's options). The harness
reaches the model through verifiers' ``TrainClient`` (its ``X-Session-ID`` is the episode's trace id) calling
``grpo.rollout.generate_endpoint``, which samples with the run's engine and settings and records each turn's
exact tokens. A row is its episode's recorded turns as one sequence: the first turn's prompt is the prompt,
every later turn's prompt must extend the previous turn's prompt and reply (what verifiers' renderer bridging
gives), the tokens between (tool results, the harness's messages) are context with loss mask 0, the replies
are trained (loss mask 1). Nothing is re-tokenised.

The task's ``@vf.reward`` functions become grpo rewards named as in verifiers, with their weights
(``reward_functions``). An episode that raises, times out or whose turns do not extend each other is a row of
zero reward for every function, logged as a warning and counted (``verifiers/failed_episodes``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from grpo.data import DataError, build_prompt_messages
from grpo.data.verifiers_env import TASK_COLUMN, environment, environment_tasks, parse_spec
from grpo.multiturn.driver import TurnsResult, padded_rows
from grpo.rewards.async_loop import run_coroutine
from grpo.rollout.engine import SamplingParams, TokenIdsEngine
from grpo.rollout.generate_endpoint import EndpointServer, GenerateEndpoint, LogprobsFn, Turn
from grpo.rollout.generation import Generation

logger = logging.getLogger(__name__)
REWARDS_COLUMN = "verifiers_rewards"  # per row: {reward name: score}, read by ``reward_functions``


@dataclass
class Row:
    """One episode as a training row."""

    prompt_ids: list[int]
    ids: list[int]  # every token after the prompt (replies and what came between)
    loss: list[int]  # 1 on the replies' tokens
    logprobs: list[float]  # the endpoint's, 0.0 between replies
    rewards: dict[str, float]
    truncated: bool
    failed: bool


def merge_turns(turns: Sequence[Turn]) -> tuple[list[int], list[int], list[int], list[float]]:
    """(prompt ids, completion ids, loss mask, log-probs) of an episode's turns as one sequence; a ValueError
    when a turn's prompt does not start with the previous turn's prompt and reply (the tokens were re-rendered)."""
    if not turns:
        raise ValueError("the episode made no model call")
    prompt = list(turns[0].prompt_ids)
    ids, loss, logprobs = list(turns[0].completion_ids), [1] * len(turns[0].completion_ids), list(turns[0].logprobs)
    for index, turn in enumerate(turns[1:], start=1):
        before = prompt + ids
        if turn.prompt_ids[:len(before)] != before:
            raise ValueError(f"turn {index}'s prompt does not extend turn {index - 1}'s prompt and reply (the "
                             "conversation was re-rendered), so its sampled tokens cannot be kept as they are")
        between = turn.prompt_ids[len(before):]
        ids += between + turn.completion_ids
        loss += [0] * len(between) + [1] * len(turn.completion_ids)
        logprobs += [0.0] * len(between) + list(turn.logprobs)
    return prompt, ids, loss, logprobs


def reward_weights(spec: str) -> dict[str, float]:
    """``{name: weight}`` of the environment's task rewards (``@vf.reward`` and config-plugged ones)."""
    tasks = environment_tasks(spec, parse_spec(spec, spec.partition(":")[2]).limit)
    return {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in tasks[0].hooks("reward")} if tasks else {}


def reward_functions(spec: str) -> tuple[list[Callable], list[float]]:
    """One grpo reward function per verifiers reward, named as it (TRL's call: ``verifiers_rewards`` is a column)."""
    functions, weights = [], []
    for name, weight in reward_weights(spec).items():
        def score(completions, verifiers_rewards, _name=name, **kwargs) -> list[float]:
            return [row.get(_name, 0.0) for row in verifiers_rewards]
        score.__name__ = name
        functions.append(score)
        weights.append(weight)
    return functions, weights


class VerifiersRollout:
    """``ExampleRollout`` over the environment that ``spec`` (a ``verifiers:`` source) names.

    Args:
        engine: the run's engine (its weights, if its own, updated through ``engine``).
        eos_ids: the ids that end a turn. logprobs_fn: the policy's log-probs, for engines that report none.
        renderer_model: what verifiers' renderer loads its tokenizer from (the policy's name or folder).
        max_model_len: the context length ``/v1/models`` reports.
    """

    def __init__(self, engine: TokenIdsEngine, tokenizer, eos_ids: list[int], spec: str, logprobs_fn: LogprobsFn,
                 renderer_model: str, max_model_len: int):
        self.engine, self.tokenizer, self.eos_ids, self.spec = engine, tokenizer, list(eos_ids), spec
        self.env = environment(spec)
        parsed = parse_spec(spec, spec.partition(":")[2])
        self.tasks = environment_tasks(spec, parsed.limit)
        self.renderer = dict(parsed.renderer) or None  # verifiers' TrainClient's renderer config
        self.reply_tokens = parsed.max_tokens  # verifiers' sampling max_tokens: each reply's cap
        self.max_concurrent, self.timeout = parsed.concurrency, parsed.timeout_s
        self.names = list(reward_weights(spec))
        self.renderer_model = renderer_model
        self.endpoint = GenerateEndpoint(engine, tokenizer, SamplingParams(), eos_ids, logprobs_fn, "grpo-policy",
                                         max_model_len)
        self.server: EndpointServer | None = None  # started at the first rollout, a daemon thread for the run
        self.extra_columns: dict[str, list] = {}
        self.failed_episodes = 0  # over the run

    def rollout(self, examples: Sequence, system_prompt: str | None, max_prompt_length: int,
                params: SamplingParams, seed: int | None) -> TurnsResult:
        G = params.n
        if self.server is None:
            self.server = EndpointServer(self.endpoint).start()
        self.endpoint.restart(replace(params, n=1), seed or 0)
        tasks = [self._task(e) for e in examples for _ in range(G)]
        # On the process's one loop: verifiers and renderers keep asyncio locks and clients across calls, bound
        # to the loop they first ran on (a fresh asyncio.run per step breaks them).
        episodes = run_coroutine(self._episodes(tasks))
        rows = [self._row(example, episode, params.max_tokens, system_prompt)
                for example, episode in zip([e for e in examples for _ in range(G)], episodes)]
        self.extra_columns = {REWARDS_COLUMN: [r.rewards for r in rows]}
        chat_prompts = [build_prompt_messages(e, system_prompt) for e in examples for _ in range(G)]
        rendered = [self.tokenizer.decode(r.prompt_ids) for r in rows[::G]]
        return TurnsResult(self._generation(rows), rendered, chat_prompts, None)

    def _task(self, example) -> Any:
        """The environment's task ``example`` stands for; a DataError for an example of another source (an eval
        set other than the training environment's tasks cannot be played by it)."""
        if example.source.rpartition("#")[0] != self.spec or TASK_COLUMN not in example.columns():
            raise DataError(f"{example.source}: not a task of {self.spec!r}, the environment this run plays; "
                            "evaluation sets must be that same source")
        return self.tasks[example.columns()[TASK_COLUMN]]

    async def _episodes(self, tasks: list) -> list[Any]:
        """Each task's episode (a ``vf.Episode``), or the exception that ended it."""
        from verifiers.v1.clients import ModelContext, TrainClientConfig  # optional extra (grpo[envs])
        from verifiers.v1.types import SamplingConfig  # optional extra (grpo[envs])

        client = TrainClientConfig(base_url=self.server.base_url, renderer_model_name=self.renderer_model,
                                   renderer=self.renderer)
        context = ModelContext(model=self.endpoint.model_name, client=client,
                               sampling=SamplingConfig(max_tokens=self.reply_tokens))
        gate = asyncio.Semaphore(self.max_concurrent)

        async def play(task):
            async with gate:
                slot = self.env.slots(task, 1)[0]
                try:
                    return await asyncio.wait_for(self.env.run_slot(slot, context), self.timeout)
                except Exception as error:  # an episode failing is its row's zero reward, never a dead run
                    return error

        async with self.env.serving():
            return await asyncio.gather(*(play(task) for task in tasks))

    def _row(self, example, episode: Any, budget: int, system_prompt: str | None) -> Row:
        problem, turns = self._problem(episode), self._turns(episode)
        if problem is None:
            try:
                prompt, ids, loss, logprobs = merge_turns(turns)
            except ValueError as error:
                problem = str(error)
        if problem is not None:
            self.failed_episodes += 1
            logger.warning("verifiers episode of %s failed (%d in this run): %s; its reward is 0",
                           example.source, self.failed_episodes, problem)
            prompt, ids, loss, logprobs = self._failed_tokens(example, turns, system_prompt)
        cut = len(ids) > budget  # the tokens between replies can pass the budget the replies keep to
        ids, loss, logprobs = ids[:budget], loss[:budget], logprobs[:budget]
        rewards = {} if problem is not None else {
            name: float(reward.score) if (reward := episode.traces[0].rewards.get(name)) is not None else 0.0
            for name in self.names}
        truncated = cut or not ids or ids[-1] not in self.eos_ids
        return Row(prompt, ids, loss, logprobs, rewards, truncated, problem is not None)

    def _turns(self, episode: Any) -> list[Turn]:
        """The endpoint's record of ``episode``'s replies (its first trace's; [] for one that never started)."""
        if isinstance(episode, BaseException) or not episode.traces:
            return []
        return self.endpoint.turns(episode.traces[0].id)

    def _failed_tokens(self, example, turns: list[Turn], system_prompt: str | None):
        """A failed episode's (prompt, ids, loss mask, log-probs): its first reply, trained with the group's zero
        reward (it was sampled); else its prompt and an end-of-turn token as context, nothing trained."""
        if turns and turns[0].completion_ids:
            first = turns[0]
            return list(first.prompt_ids), list(first.completion_ids), [1] * len(first.completion_ids), \
                list(first.logprobs)
        prompt = self.tokenizer.apply_chat_template(build_prompt_messages(example, system_prompt), tokenize=True,
                                                    add_generation_prompt=True, return_dict=False)
        return list(prompt), [self.eos_ids[0]], [0], [0.0]

    def _problem(self, episode: Any) -> str | None:
        """Why ``episode`` yields no reward, or None."""
        if isinstance(episode, TimeoutError):
            return f"timed out after {self.timeout:g} s"
        if isinstance(episode, BaseException):
            return f"{type(episode).__name__}: {episode}"
        if not episode.traces:
            return "the episode ran no agent"
        errors = [*episode.errors, *episode.traces[0].errors]
        if errors or not episode.ok:
            first = errors[0] if errors else None
            return f"{first.type}: {first.message}" if first is not None else "the episode did not complete"
        return None

    def _generation(self, rows: list[Row]) -> Generation:
        t = padded_rows(rows, self.tokenizer.pad_token_id)
        return Generation(
            prompt_ids=t.prompt_ids, prompt_mask=t.prompt_mask, completion_ids=t.completion_ids,
            completion_mask=t.completion_mask, truncated=t.truncated,
            completions=self.tokenizer.batch_decode(t.completion_ids, skip_special_tokens=True),
            sampler_logprobs=t.sampler_logprobs if self.endpoint.engine_logprobs else None,
            loss_mask=t.loss_mask,
            rollout_metrics={"verifiers/failed_episodes": sum(r.failed for r in rows) / len(rows)})
