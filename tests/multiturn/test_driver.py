"""The multi-turn driver over a scripted engine: tool calls parsed, run, rendered by the chat template; the
sampled tokens kept as they were; the loss mask 1 on sampled tokens only; failures answered, never raised."""

import asyncio
import copy
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from grpo.data import Example
from grpo.multiturn.driver import MultiTurnRollout
from grpo.multiturn.environments import Environments
from grpo.multiturn.tools import load_callable
from grpo.rollout.engine import SamplingParams, completion_mask_from_ids
from grpo.rollout.hf import left_pad
from grpo.rollout.generation import Generation


def qwen25_template() -> str:
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = qwen25_template()
    return tokenizer


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: integers with + - * and parentheses.
    """
    if not set(expression) <= set("0123456789+-*() "):
        raise ValueError(f"bad expression {expression!r}")
    return str(eval(expression))  # the test's own inputs only


def slow_tool(x: int) -> str:
    """Sleep.

    Args:
        x: seconds.
    """
    time.sleep(x)
    return "late"


async def async_double(x: int) -> dict:
    """Double a number.

    Args:
        x: the number.
    """
    await asyncio.sleep(0)
    return {"value": 2 * x}


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'


class ScriptedEngine:
    """``generate_ids`` that answers each context with ``script(context text, row)``; records its calls."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate_ids(self, prompt_ids, params: SamplingParams, seed=None) -> Generation:
        self.calls.append(([list(p) for p in prompt_ids], params))
        texts = [self.script(self.tokenizer.decode(p), j) for p in prompt_ids for j in range(params.n)]
        pad = self.tokenizer.pad_token_id
        encoded = [self.tokenizer(t, add_special_tokens=False)["input_ids"][:params.max_tokens] for t in texts]
        ids = torch.tensor([e + [pad] * (max(map(len, encoded)) - len(e)) for e in encoded])
        mask, truncated = completion_mask_from_ids(ids, [self.tokenizer.convert_tokens_to_ids("<|im_end|>")])
        prompt_ids_t, prompt_mask = left_pad(prompt_ids, pad)
        return Generation(prompt_ids_t.repeat_interleave(params.n, 0), prompt_mask.repeat_interleave(params.n, 0),
                          ids.masked_fill(mask == 0, pad), mask, truncated, texts)


def example(question: str, answer: str = "5") -> Example:
    return Example(messages=[{"role": "user", "content": question}], answer=answer, answer_raw=answer, source="t#0")


def run(tokenizer, script, tools, examples, n=2, max_tokens=200, max_iterations=None, environments=None,
        timeout_s=5.0):
    engine = ScriptedEngine(tokenizer, script)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    driver = MultiTurnRollout(engine, tokenizer, eos, tools, environments, max_iterations, timeout_s)
    result = driver.rollout(examples, "Use tools.", 4096, SamplingParams(n=n, max_tokens=max_tokens), 0)
    return engine, result


def test_a_tool_round_keeps_the_sampled_tokens_and_masks_the_tool_result(tool_tokenizer):
    def script(context, j):
        if "<tool_response>" not in context:
            return call("calculator", expression="2+3") if j == 0 else "<answer>4</answer><|im_end|>"
        return "<answer>5</answer><|im_end|>"

    engine, result = run(tool_tokenizer, script, [calculator], [example("2+3?")])
    g = result.generation
    assert g.loss_mask is not None and bool((g.loss_mask <= g.completion_mask).all())
    # Row 0: the call, the template's tool turn (no loss), the answer; row 1 answered at once.
    first_turn = tool_tokenizer(call("calculator", expression="2+3"), add_special_tokens=False)["input_ids"]
    row0 = g.completion_ids[0][g.completion_mask[0].bool()].tolist()
    assert row0[:len(first_turn)] == first_turn
    inserted = [t for t, m in zip(row0, g.loss_mask[0].tolist()) if m == 0]
    assert "<tool_response>\n5\n</tool_response>" in tool_tokenizer.decode(inserted)
    assert tool_tokenizer.decode(inserted).endswith("<|im_start|>assistant\n")
    assert g.loss_mask[1].tolist() == g.completion_mask[1].tolist()
    # The second turn continued from the exact ids: prompt + first turn + tool suffix.
    continued = engine.calls[1][0][0]
    assert continued == g.prompt_ids[0][g.prompt_mask[0].bool()].tolist() + row0[:len(continued) - int(g.prompt_mask[0].sum())]
    assert [m["role"] for m in g.messages[0]] == ["assistant", "tool", "assistant"]
    assert g.messages[0][0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2+3"}}
    assert g.messages[0][1] == {"role": "tool", "name": "calculator", "content": "5"}
    assert g.rollout_metrics == {"tools/calls_per_completion": 0.5, "tools/failure_rate": 0.0, "tools/turns": 1.5}
    assert not g.truncated.any()
    # The prompt rendered the tool schema (Qwen2.5: <tools> in the system turn).
    assert "<tools>" in result.prompts[0] and '"name": "calculator"' in result.prompts[0]


def test_a_raising_hanging_unknown_or_malformed_call_is_answered_with_an_error(tool_tokenizer):
    calls = {0: call("calculator", expression="import os"), 1: call("slow_tool", x=3),
             2: call("nope"), 3: "<tool_call>\n{not json\n</tool_call><|im_end|>"}

    def script(context, j):
        return "<answer>0</answer><|im_end|>" if "<tool_response>" in context else calls[j]

    started = time.monotonic()
    _, result = run(tool_tokenizer, script, [calculator, slow_tool], [example("?")], n=4, timeout_s=0.5)
    assert time.monotonic() - started < 2.5  # the hanging call did not hold the rollout
    messages = result.generation.messages
    errors = [json.loads(m[1]["content"])["error"] for m in messages]
    assert "bad expression" in errors[0] and "timed out" in errors[1] and "not found" in errors[2]
    assert "not valid JSON" in errors[3]
    assert result.generation.rollout_metrics["tools/failure_rate"] == 1.0


def test_async_tools_and_non_text_results(tool_tokenizer):
    def script(context, j):
        return "<answer>8</answer><|im_end|>" if "<tool_response>" in context else call("async_double", x=4)

    _, result = run(tool_tokenizer, script, [async_double], [example("?")], n=1)
    assert json.loads(result.generation.messages[0][1]["content"]) == {"value": 8}


def test_iterations_and_the_budget_bound_the_rollout(tool_tokenizer):
    def script(context, j):
        return call("calculator", expression="1+1")  # calls forever

    engine, result = run(tool_tokenizer, script, [calculator], [example("?")], n=1, max_tokens=2000, max_iterations=2)
    assert len(engine.calls) == 3 and result.generation.rollout_metrics["tools/turns"] == 3
    engine, result = run(tool_tokenizer, script, [calculator], [example("?")], n=1, max_tokens=120)
    g = result.generation
    assert int(g.completion_mask.sum()) <= 120 and bool(g.truncated[0])


class Counter:
    instances = 0

    def __init__(self):
        Counter.instances += 1
        self.total = 0

    def reset(self, **row):
        self.total = int(row["start"])
        return f" Start at {self.total}."

    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much.
        """
        self.total += amount
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total == 10)


def test_an_environment_resets_per_rollout_and_exposes_its_methods_and_reward(tool_tokenizer):
    def script(context, j):
        return "<answer>done</answer><|im_end|>" if "<tool_response>" in context else call("add", amount=7 + j)

    rows = [Example(messages=[{"role": "user", "content": "Count."}], answer=None, answer_raw=None, source="e#0",
                    row={"start": 3})]
    envs = Environments(Counter)
    _, result = run(tool_tokenizer, script, [], rows, n=2, environments=envs)
    assert [e.total for e in result.environments] == [10, 11]
    assert result.chat_prompts[0][-1]["content"].endswith("Count. Start at 3.")
    (reward,) = envs.reward_functions()
    assert reward(environments=result.environments) == [1.0, 0.0]
    assert reward.__name__ == "Counter"


class Unreachable(Counter):
    """A client of a server that is down on the first reset and whose reward cannot be read."""

    resets = 0

    def reset(self, **row):
        Unreachable.resets += 1
        if Unreachable.resets == 1:
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        return super().reset(**row)

    def get_reward(self) -> float:
        raise ConnectionError("server gone")


def test_an_environment_that_raises_is_an_error_observation_or_a_zero_reward_counted(tool_tokenizer, caplog):
    def script(context, j):
        return "<answer>done</answer><|im_end|>"

    rows = [Example(messages=[{"role": "user", "content": "Count."}], answer=None, answer_raw=None, source="e#0",
                    row={"start": 3})]
    envs = Environments(Unreachable)
    with caplog.at_level("WARNING", logger="grpo.multiturn.environments"):
        _, result = run(tool_tokenizer, script, [], rows, n=2, environments=envs)
        (reward,) = envs.reward_functions()
        assert reward(environments=result.environments) == [0.0, 0.0]
    assert result.chat_prompts[0][-1]["content"] == (
        'Count.\n{"error": "ConnectionRefusedError: [Errno 111] Connection refused"}')
    assert result.chat_prompts[1][-1]["content"].endswith("Count. Start at 3.")
    assert result.generation.rollout_metrics["tools/reset_failure_rate"] == 0.5
    assert envs.failures == {"reset": 1, "get_reward": 2}
    assert "Unreachable.reset raised ConnectionRefusedError" in caplog.text
    assert "(2 get_reward failures so far)" in caplog.text


def test_an_environment_needing_a_missing_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)  # as if not installed: its import raises
    (tmp_path / "needs_openenv.py").write_text("import openenv\n\nclass Env:\n    def reset(self, **row):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"rollout.environment: cannot import .*pip install 'grpo\[openenv\]'"):
        load_callable("needs_openenv:Env", "rollout.environment")

    class LazyClient:
        def __init__(self):
            import openenv  # noqa: F401

        def reset(self, **row):
            pass

    with pytest.raises(ImportError, match=r"environment None: .*openenv.*pip install 'grpo\[openenv\]'"):
        Environments(LazyClient)


def test_a_template_without_tools_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="tool"):
        MultiTurnRollout(ScriptedEngine(tiny_tokenizer, None), tiny_tokenizer, [2], [calculator], None, None, 1.0)


def test_a_tool_without_a_docstring_is_refused(tool_tokenizer):
    def bare(x):
        return x

    with pytest.raises(ValueError, match="bare"):
        MultiTurnRollout(ScriptedEngine(tool_tokenizer, None), tool_tokenizer, [2], [bare], None, None, 1.0)


class CachingScriptedEngine(ScriptedEngine):
    """A ``PrefixCachingEngine``: records when the driver opens and closes its per-rollout cache."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.events = []

    @contextmanager
    def cached_turns(self):
        self.events.append("open")
        try:
            yield self
        finally:
            self.events.append("closed")


def test_the_driver_keeps_an_engine_s_cache_for_one_rollout_only(tool_tokenizer):
    # Every turn goes through the rollout's cache context, which is closed when the rollout ends, also when a
    # turn raises: keys/values from this step's weights can never reach the next step.
    def script(context, j):
        if "<tool_response>" not in context:
            return call("calculator", expression="2+3")
        return "<answer>5</answer><|im_end|>"

    engine = CachingScriptedEngine(tool_tokenizer, script)
    eos = [tool_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    driver = MultiTurnRollout(engine, tool_tokenizer, eos, [calculator], None, None, 5.0)
    params = SamplingParams(n=2, max_tokens=200)
    driver.rollout([example("2+3?")], "Use tools.", 4096, params, 0)
    assert engine.events == ["open", "closed"] and len(engine.calls) == 2

    def broken(context, j):
        raise RuntimeError("engine failed")

    engine.script = broken
    with pytest.raises(RuntimeError, match="engine failed"):
        driver.rollout([example("2+3?")], "Use tools.", 4096, params, 0)
    assert engine.events == ["open", "closed", "open", "closed"]
