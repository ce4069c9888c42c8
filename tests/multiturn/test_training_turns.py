"""Multi-turn training end to end on assets/tiny-tools (a model SFT-taught to call a calculator sometimes):
a TRL-style script with ``tools=[calculator]`` through grpo's Python API, an environment class from a recipe,
and tools that raise, hang past their timeout or return non-text, none of which stops the run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from grpo import GRPOConfig, GRPOTrainer
from grpo.cli import main

pytestmark = pytest.mark.integration
TINY_TOOLS = Path(__file__).resolve().parents[2] / "assets" / "tiny-tools"


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "tools/calls_per_completion" in r]


# ---------------------------------------------------------------- a TRL-style script


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, e.g. "12 * 34".
    """
    digits = sum(c.isdigit() for c in expression)
    if digits % 3 == 0:  # a third of the calls: the tool raises (the model reads the error)
        raise ValueError(f"cannot evaluate {expression!r}")
    if digits % 3 == 1:  # another third: hangs past rollout.tool_timeout_s
        time.sleep(1.5)
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        raise ValueError(f"unsupported characters in {expression!r}")
    return {"result": eval(expression)}  # noqa: S307 (checked characters); a dict, not text


def answer_reward(completions, answer, **kwargs):
    """TRL's multi-turn completions: the message list; the last message is the final answer."""
    return [1.0 if f"<answer>\n{a}\n</answer>" in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]


def test_a_trl_script_with_tools_trains_and_failing_tools_never_stop_it(tmp_path, caplog):
    from grpo.data.arithmetic_tools import generate_tool_problems

    rows = [{"prompt": [{"role": "user", "content": e.question}], "answer": e.answer}
            for e in generate_tool_problems(64, seed=5, size="large")]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=96, max_steps=3, learning_rate=3e-5, logging_steps=1, save_steps=3,
                      use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, seed=2,
                      max_tool_calling_iterations=1, grpo_overrides={"rollout.tool_timeout_s": 0.5},
                      log_completions=True)
    trainer = GRPOTrainer(model=str(TINY_TOOLS), reward_funcs=answer_reward, args=args, train_dataset=rows,
                          tools=[calculator])
    with caplog.at_level("INFO", logger="grpo.multiturn.tools"):
        trainer.train()
    logged = metrics(tmp_path / "run")
    assert len(logged) == 3
    calls = sum(r["tools/calls_per_completion"] for r in logged)
    assert calls > 0, "the tiny tool model made no call in 3 steps x 16 completions"
    assert all(0.0 <= r["tools/failure_rate"] <= 1.0 for r in logged)
    assert any(r["tools/failure_rate"] > 0 for r in logged)  # raising and hanging calls are failures
    assert all(r["tools/turns"] >= 1.0 for r in logged)
    assert not (tmp_path / "run" / "final").exists()  # the API saves a final model only when asked, as TRL
    failures = [r for r in caplog.records if r.name == "grpo.multiturn.tools"
                and any(word in r.getMessage() for word in ("refused", "raised", "rollout.tool_timeout_s"))]
    assert failures, "tool failures were not logged"
    assert failures[0].levelname == "WARNING"  # the first of each kind; the rest at INFO
    history = [h for h in trainer.state.log_history if "tools/call_frequency" in h]  # TRL's names
    assert len(history) == 3 and all(0.0 <= h["tools/failure_frequency"] <= 1.0 for h in history)
    # a multi-turn completion is recorded as its messages: samples.jsonl and log_completions' parquet
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["completion"][0]["role"] == "assistant" for s in samples)
    import pandas as pd

    files = sorted((tmp_path / "run" / "completions").glob("completions_*.parquet"))
    assert [f.name for f in files] == [f"completions_{step:05d}.parquet" for step in (1, 2, 3)]
    turns = [m for f in files for c in pd.read_parquet(f)["completion"] for m in c]
    assert any(m["role"] == "tool" and m["content"] for m in turns), "no tool result in the logged completions"


# ---------------------------------------------------------------- an environment from a recipe

ENVIRONMENT = '''
class CalculatorEnv:
    """One rollout's state: the problem's answer, the calls made."""

    def reset(self, answer, **row):
        self.answer, self.results = answer, []
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression to evaluate.
        """
        if not set(expression) <= set("0123456789+-*/(). "):
            raise ValueError("unsupported characters")
        result = str(eval(expression))
        self.results.append(result)
        return result

    def get_reward(self):
        return 1.0 if self.answer in self.results else 0.0
'''

RECIPE = """\
model: {{name_or_path: {model}}}
data:
  train: arithmetic-tools:seed=5,n=64,size=large
  tag_style: think
rollout:
  num_generations: 8
  max_completion_length: 96
  environment: calc_env_for_test:CalculatorEnv
  max_tool_calling_iterations: 1
optim: {{learning_rate: 3.0e-5}}
train: {{prompts_per_step: 8, micro_batch_size: 64, max_steps: 2, save_steps: 2, output_dir: {out}, seed: 3}}
log: {{report_to: [], progress_bar: false, plots: false, logging_steps: 1}}
rewards: []
"""


def test_an_environment_class_from_a_recipe_trains_with_its_reward(tmp_path, monkeypatch):
    (tmp_path / "calc_env_for_test.py").write_text(ENVIRONMENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=TINY_TOOLS, out=out))
    assert main(["train", str(recipe)]) == 0
    logged = metrics(out)
    assert len(logged) == 2
    assert sum(r["tools/calls_per_completion"] for r in logged) > 0
    rewards = [r["reward/CalculatorEnv"] for r in logged]  # get_reward, named after the class, as TRL
    assert all(0.0 <= x <= 1.0 for x in rewards)


def test_no_reward_at_all_is_a_configuration_error_naming_both_sources(tmp_path, monkeypatch):
    from grpo.config import ConfigError

    (tmp_path / "calc_env_no_reward.py").write_text(ENVIRONMENT.replace("def get_reward", "def _get_reward"))
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=TINY_TOOLS, out=tmp_path / "run").replace(
        "calc_env_for_test", "calc_env_no_reward"))
    assert main(["train", str(recipe)]) == 2
    from grpo.config import load_config
    from grpo.multiturn.wiring import turn_spec

    with pytest.raises(ConfigError, match="define no get_reward"):
        turn_spec(load_config(recipe)).with_environment_rewards([], [])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_grpo_eval_answers_with_the_tools_and_reports_their_metrics(tmp_path):
    report = tmp_path / "report.json"
    args = ["eval", str(TINY_TOOLS), "--data", "arithmetic-tools:seed=123,n=16,size=large", "--samples", "4",
            "--max-new-tokens", "96", "--no-progress", "--output", str(report)]
    assert main([*args, "--tools", "grpo.multiturn.calculator:calculator"]) == 0
    with_tools = json.loads(report.read_text())
    assert with_tools["tools"] == ["grpo.multiturn.calculator:calculator"]
    assert "tools/calls_per_completion" in with_tools and with_tools["tools/turns"] >= 1.0
    # sampled answers that called the calculator are right; alone the model cannot multiply large numbers
    assert with_tools["mean_sample_accuracy"] > 0
    assert main([*args, "--tools"]) == 0  # none: the model answers alone, no tool metrics
    alone = json.loads(report.read_text())
    assert alone["tools"] == [] and "tools/calls_per_completion" not in alone
