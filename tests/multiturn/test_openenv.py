"""An OpenEnv client as an environment (TRL's environment_factory) against an echo server started here (the
package ``openenv init`` writes; tests/openenv_server.py): the tiny tool model's calculator calls step the server
and its reward trains 2 steps; with the server down, every reset and call fails and the run still ends, its
rollouts scored zero and the failures counted. The guide's own scripts run under TRL and grpo in
tests/trl_scripts (openenv_echo*)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from openenv_server import echo_server  # noqa: F401 (a fixture)
from transport_helpers import free_port

from grpo import GRPOConfig, GRPOTrainer
from grpo.data.arithmetic_tools import generate_tool_problems

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TINY_TOOLS = Path(__file__).resolve().parents[2] / "assets" / "tiny-tools"


def echo_environment(url: str):
    """The guide's EchoToolEnv with the tool the tiny model calls (calculator): each call is echoed by the
    server, whose reward (0.1 per character, at most 1) is the rollout's; reset resets the server's episode."""
    from echo_env import EchoEnv
    from echo_env.models import EchoAction

    class EchoCalculatorEnv:
        steps = []

        def __init__(self):
            self.env = EchoEnv(base_url=url)

        def reset(self, **kwargs) -> str | None:
            self.reward = 0.0
            self.env.reset()
            return None

        def calculator(self, expression: str) -> str:
            """Evaluate an arithmetic expression.

            Args:
                expression: The expression to evaluate.
            """
            result = self.env.step(EchoAction(message=expression))
            self.reward = result.observation.reward
            EchoCalculatorEnv.steps.append(result.observation.echoed_message)
            return result.observation.echoed_message

    return EchoCalculatorEnv


def reward_func(environments, **kwargs):
    return [env.reward for env in environments]


def train(out: Path, url: str, package_root: Path, caplog):
    sys.path.insert(0, str(package_root))
    try:
        environment = echo_environment(url)
    finally:
        sys.path.remove(str(package_root))
    rows = [{"prompt": [{"role": "user", "content": e.question}], "answer": e.answer}
            for e in generate_tool_problems(16, seed=6, size="large")]
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
                      max_steps=2, learning_rate=1e-5, logging_steps=1, save_steps=2, use_cpu=True, bf16=False,
                      report_to="none", disable_tqdm=True, seed=6, max_tool_calling_iterations=1,
                      chat_template_kwargs={"enable_thinking": False})
    trainer = GRPOTrainer(model=str(TINY_TOOLS), reward_funcs=reward_func, args=args, train_dataset=rows,
                          environment_factory=environment)
    with caplog.at_level("WARNING"):
        trainer.train()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return trainer, environment, [r for r in logged if "tools/calls_per_completion" in r]


def test_an_openenv_client_environment_trains_on_the_server_s_reward(echo_server, tmp_path, caplog):
    trainer, environment, logged = train(tmp_path / "run", echo_server.url, echo_server.package_root, caplog)
    assert trainer.state.global_step == 2 and len(logged) == 2
    assert environment.steps, "the tiny tool model made no call in 2 steps x 8 completions"
    assert all(r["tools/reset_failure_rate"] == 0.0 for r in logged)
    rewards = [h["rewards/reward_func/mean"] for h in trainer.state.log_history if "rewards/reward_func/mean" in h]
    assert len(rewards) == 2 and max(rewards) > 0  # the server's reward for the echoed expressions
    assert "raised" not in caplog.text


def test_with_the_server_down_the_run_ends_with_zero_rewards_and_counted_failures(echo_server, tmp_path, caplog):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trainer, environment, logged = train(tmp_path / "run", down, echo_server.package_root, caplog)
    assert trainer.state.global_step == 2 and len(logged) == 2
    assert all(r["tools/reset_failure_rate"] == 1.0 for r in logged)  # every rollout saw the error, none died
    assert not environment.steps
    assert all(h["rewards/reward_func/mean"] == 0.0 for h in trainer.state.log_history
               if "rewards/reward_func/mean" in h)
    assert "EchoCalculatorEnv.reset raised" in caplog.text and "(16 reset failures so far)" in caplog.text
