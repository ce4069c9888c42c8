"""Multi-turn rollouts: the model's turns alternate with tool results in one token sequence per row.

Turn 1 samples ``G`` completions per prompt (each row's prompt rendered with its tools' schemas). After each
turn the row's tool calls are parsed from its text, run (all rows' calls of a turn together), and their
results appended as ``tool`` messages rendered by the chat template (``conversation.tool_suffix_ids``: the
sampled tokens stay as they were); every row with calls then continues from its own exact token ids. A row
stops at a turn without calls, at ``max_iterations`` tool rounds, or at the completion budget
(``params.max_tokens``: tool tokens count toward it; a tool result that does not fit ends the row, marked
truncated). Every row's turn is sampled in one engine call, so a row waits at most a turn for the others.
An engine that can keep the rows' keys/values (``PrefixCachingEngine``: ``hf``, ``hf-static``) keeps them for
the rollout, so a turn prefills only the row's new tokens; vLLM's own prefix caching does the same for it.

The result is one ``Generation``: ``completion_ids`` are all tokens after the prompt (sampled and inserted),
``loss_mask`` is 1 on sampled ones only, ``messages`` the completion as chat messages for rewards.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from grpo.data import DataError, PromptTooLong, build_prompt_messages
from grpo.multiturn.conversation import check_tool_template, tool_suffix_ids
from grpo.multiturn.environments import Environments, environment_methods
from grpo.multiturn.tool_calls import TOOL_CALL_FORMATS, ToolCall, detect_format
from grpo.multiturn.tools import PendingCall, Toolbox, ToolOutcome
from grpo.rollout.engine import PrefixCachingEngine, RolloutEngine, SamplingParams, TokenIdsEngine
from grpo.rollout.generation import Generation
from grpo.rollout.hf import left_pad

# Tool round k samples with seed + k * this: a seed of its own, far from the seeds a call's neighbours use
# (seed + 1, seed + 2, ... for the next calls of an evaluation), so two rounds never draw the same stream.
TURN_SEED_STRIDE = 7919


def environment_row(example) -> dict:
    """What ``reset(**row)`` gets: the row's columns and its ``prompt`` messages, as TRL passes a dataset row."""
    return {**example.columns(), "prompt": [dict(m) for m in example.messages]}


@dataclass
class Row:
    """One rollout in progress."""

    prompt_ids: list[int]
    toolbox: Toolbox
    environment: Any = None
    ids: list[int] = field(default_factory=list)  # completion tokens so far (sampled and inserted)
    loss: list[int] = field(default_factory=list)  # 1 where sampled
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 on inserted tokens
    messages: list[dict] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    turns: int = 0
    truncated: bool = False
    reset_failed: bool = False  # its environment's reset raised (the prompt carries the error)
    pending: list[ToolCall] = field(default_factory=list)  # the last turn's calls, not yet run


@dataclass
class PaddedRows:
    """Multi-turn rows as a batch: prompts left-padded ``[N, Lp]``, each row's turns (replies and what came
    between them) right-padded ``[N, Lc]`` with their completion and loss masks and sampler log-probs."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    truncated: torch.Tensor


def padded_rows(rows: Sequence[Any], pad: int) -> PaddedRows:
    """``rows``: objects with ``prompt_ids``, ``ids``, ``loss``, ``logprobs`` (per token) and ``truncated``."""
    prompt_ids, prompt_mask = left_pad([r.prompt_ids for r in rows], pad)
    width = max(1, max(len(r.ids) for r in rows))

    def right(values: list, fill) -> list:
        return values + [fill] * (width - len(values))

    return PaddedRows(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=torch.tensor([right(r.ids, pad) for r in rows], dtype=torch.long),
        completion_mask=torch.tensor([right([1] * len(r.ids), 0) for r in rows], dtype=torch.long),
        loss_mask=torch.tensor([right(r.loss, 0) for r in rows], dtype=torch.long),
        sampler_logprobs=torch.tensor([right(r.logprobs, 0.0) for r in rows], dtype=torch.float32),
        truncated=torch.tensor([r.truncated for r in rows]))


@dataclass
class TurnsResult:
    """What a multi-turn rollout gives ``sample_and_score``."""

    generation: Generation
    prompts: list[str]  # P rendered prompts, one per group (its first row's)
    chat_prompts: list[Any]  # N prompts as rewards get them (message lists, the environment's text appended)
    environments: list[Any] | None  # N instances, for their get_reward and the rewards' ``environments``


@runtime_checkable
class ExampleRollout(Protocol):
    """An engine wrapper that makes a step's rollouts from the examples themselves (it renders their prompts:
    tools' schemas, environments' observations): ``MultiTurnRollout`` and ``rollout_hook.RolloutHook``.
    ``engine`` is the engine it wraps: the one whose weights (its own, if it has them) the trainer updates."""

    engine: RolloutEngine

    def rollout(self, examples: Sequence, system_prompt: str | None, max_prompt_length: int,
                params: SamplingParams, seed: int | None) -> TurnsResult:
        ...


def sampling_engine(engine) -> RolloutEngine:
    """The engine that samples for ``engine``: the one an ``ExampleRollout`` wraps, else ``engine`` itself. Its
    abilities (``OwnWeightsEngine``: update_weights, sleep) are asked of it, never of the wrapper."""
    return engine.engine if isinstance(engine, ExampleRollout) else engine


class MultiTurnRollout:
    """Wraps a rollout engine that has ``generate_ids`` with tool calling and environments.

    Args:
        engine: the run's engine (its own weights, if any, are updated through ``engine``).
        eos_ids: the ids that end a turn (``grpo.models.wrappers.eos_token_ids``).
        tools: standalone tool callables. environments: ``Environments`` or None.
        max_iterations: tool rounds after the first turn (None: until the budget).
        tool_timeout_s: bound of one call. tool_call_format: "auto" or a ``TOOL_CALL_FORMATS`` name.
    """

    def __init__(self, engine, tokenizer, eos_ids: list[int], tools: Sequence, environments: Environments | None,
                 max_iterations: int | None, tool_timeout_s: float, tool_call_format: str = "auto"):
        if not isinstance(engine, TokenIdsEngine):
            raise ValueError(f"rollout engine {type(engine).__name__} cannot continue from token ids, so it cannot "
                             "run multi-turn rollouts")
        self.engine, self.tokenizer, self.eos_ids, self.tools = engine, tokenizer, list(eos_ids), list(tools)
        self.environments, self.max_iterations, self.tool_timeout_s = environments, max_iterations, tool_timeout_s
        self.parse = TOOL_CALL_FORMATS[detect_format(getattr(tokenizer, "chat_template", None), tool_call_format)]
        probe = Toolbox(self.tools + self._probe_methods(), tool_timeout_s)  # every schema checked now
        self.warned: set = set()  # the run's tool warnings already given (see Toolbox)
        check_tool_template(tokenizer, probe.schemas)

    def _probe_methods(self) -> list:
        if self.environments is None:
            return []
        return [m for pool in self.environments.pool.values() for m in environment_methods(pool[0])]

    def rollout(self, examples: Sequence, system_prompt: str | None, max_prompt_length: int,
                params: SamplingParams, seed: int | None) -> TurnsResult:
        """``params.n`` multi-turn rollouts per example, rows grouped per example."""
        G = params.n
        rows, chat_prompts, texts = [], [], []
        envs = (self.environments.instances([environment_row(e) for e in examples for _ in range(G)])
                if self.environments else None)
        for i, example in enumerate(examples):
            if example.plain_text:
                raise DataError(f"{example.source}: tools need conversational prompts (chat messages), not plain text")
            for g in range(G):
                k = i * G + g
                env = envs[k] if envs else None
                messages = build_prompt_messages(example, system_prompt)
                reset_failed = False
                if env is not None:
                    observation, reset_failed = self.environments.reset(env, environment_row(example))
                    if observation:
                        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
                toolbox = Toolbox(self.tools + (environment_methods(env) if env is not None else []),
                                  self.tool_timeout_s, self.warned)
                text = self.tokenizer.apply_chat_template(messages, tools=toolbox.schemas or None, tokenize=False,
                                                          add_generation_prompt=True)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(ids) > max_prompt_length:
                    raise PromptTooLong(example.source, len(ids), max_prompt_length, "prompt with its tools")
                rows.append(Row(ids, toolbox, env, reset_failed=reset_failed))
                chat_prompts.append(messages)
                texts.append(text)
        # An engine that can keep the rows' keys/values does so for this rollout only (the weights change after)
        with (self.engine.cached_turns() if isinstance(self.engine, PrefixCachingEngine)
              else nullcontext(self.engine)) as engine:
            self._turns(engine, rows, params, seed, self.eos_ids)
        return TurnsResult(self._generation(rows), texts[::G], chat_prompts, envs)

    def _turns(self, engine: TokenIdsEngine, rows: list[Row], params: SamplingParams, seed: int | None,
               eos_ids: list[int]) -> None:
        budget, G = params.max_tokens, params.n
        shared = all(rows[i].prompt_ids == rows[i - i % G].prompt_ids for i in range(len(rows)))
        if shared:  # one prefill per prompt, G samples each
            first = engine.generate_ids([r.prompt_ids for r in rows[::G]], params, seed=seed)
        else:
            first = engine.generate_ids([r.prompt_ids for r in rows], replace(params, n=1), seed=seed)
        self._sampler_logprobs = first.sampler_logprobs is not None  # an engine with its own weights (vLLM)
        active = list(range(len(rows)))
        self._take(rows, active, first, eos_ids, budget)
        iteration = 0
        while True:
            calling = [k for k in active if self._has_calls(rows[k])]
            if not calling or (self.max_iterations is not None and iteration >= self.max_iterations):
                return
            continuing = self._run_tools(rows, calling, eos_ids, budget)
            if not continuing:
                return
            iteration += 1
            room = max(budget - len(rows[k].ids) for k in continuing)
            turn_seed = None if seed is None else seed + TURN_SEED_STRIDE * iteration
            out = engine.generate_ids([rows[k].prompt_ids + rows[k].ids for k in continuing],
                                      replace(params, n=1, max_tokens=room, min_new_tokens=0), seed=turn_seed)
            self._take(rows, continuing, out, eos_ids, budget)
            active = continuing

    def _take(self, rows: list[Row], which: list[int], out: Generation, eos_ids: list[int], budget: int) -> None:
        """Append each row's sampled turn (cut to its remaining budget) and its assistant message."""
        for j, k in enumerate(which):
            row = rows[k]
            tokens = out.completion_ids[j][out.completion_mask[j].bool()].tolist()
            tokens = tokens[:budget - len(row.ids)]
            lps = (out.sampler_logprobs[j, :len(tokens)].tolist() if out.sampler_logprobs is not None
                   else [0.0] * len(tokens))
            row.ids += tokens
            row.loss += [1] * len(tokens)
            row.logprobs += lps
            row.turns += 1
            row.truncated = not tokens or tokens[-1] not in eos_ids
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            content, calls = self.parse(text)
            message = {"role": "assistant", "content": content if calls else text}
            if calls:
                message["tool_calls"] = [c.message() for c in calls]
            row.pending = calls
            row.messages.append(message)

    @staticmethod
    def _has_calls(row: Row) -> bool:
        return bool(row.pending) and not row.truncated

    def _run_tools(self, rows: list[Row], calling: list[int], eos_ids: list[int], budget: int) -> list[int]:
        """Run every calling row's calls together; append the results that fit. The rows that go on."""
        started = {k: [self._start(rows[k].toolbox, c) for c in rows[k].pending] for k in calling}
        continuing = []
        for k in calling:
            row = rows[k]
            row.pending = []
            outcomes: list[ToolOutcome] = [p.outcome() for p in started[k]]
            row.calls += len(outcomes)
            row.failures += sum(o.failed for o in outcomes)
            tool_messages = [{"role": "tool", "name": o.name, "content": o.text} for o in outcomes]
            suffix = tool_suffix_ids(self.tokenizer, tool_messages, eos_ids)
            if len(row.ids) + len(suffix) >= budget:  # no room for the results and a reply: the row ends here
                row.truncated = True
                continue
            row.ids += suffix
            row.loss += [0] * len(suffix)
            row.logprobs += [0.0] * len(suffix)
            row.messages += tool_messages
            continuing.append(k)
        return continuing

    @staticmethod
    def _start(toolbox: Toolbox, call: ToolCall) -> PendingCall:
        if call.error is not None:  # malformed: answered with the parse error
            return PendingCall(toolbox, call.name or "unknown", None, error=call.error)
        return toolbox.start(call.name, call.arguments)

    def _generation(self, rows: list[Row]) -> Generation:
        t = padded_rows(rows, self.tokenizer.pad_token_id)
        n = len(rows)
        calls = sum(r.calls for r in rows)
        metrics = {"tools/calls_per_completion": calls / n,
                   "tools/failure_rate": sum(r.failures for r in rows) / calls if calls else 0.0,
                   "tools/turns": sum(r.turns for r in rows) / n}
        if self.environments is not None:
            metrics["tools/reset_failure_rate"] = sum(r.reset_failed for r in rows) / n
        return Generation(
            prompt_ids=t.prompt_ids, prompt_mask=t.prompt_mask, completion_ids=t.completion_ids,
            completion_mask=t.completion_mask, truncated=t.truncated,
            completions=self.tokenizer.batch_decode(t.completion_ids, skip_special_tokens=True),
            sampler_logprobs=t.sampler_logprobs if self._sampler_logprobs else None,
            loss_mask=t.loss_mask, messages=[r.messages for r in rows], rollout_metrics=metrics)
