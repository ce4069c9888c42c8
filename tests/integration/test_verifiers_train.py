"""verifiers environments end to end on a tiny model (grpo.data.verifiers_env, grpo.multiturn.verifiers_rollout,
grpo.rollout.generate_endpoint): a taskset played by a single-agent harness and one played by a multi-turn tool
harness (tests/integration/vf_echo_env.py, vf_tools_env.py) each train 2 steps, colocated and on 2 ranks, with their rewards logged
under their names, every trained row's sampled tokens exactly the endpoint's replies of its episode; an episode
that raises or hangs is a zero reward and a counted warning, never a dead run."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

pytest.importorskip("verifiers.v1")

from run_helpers import SMOKE, as_overrides, cli_env, free_port

from grpo.config import load_config
from grpo.models.tiny import build_qwen2, build_tokenizer
from grpo.multiturn import verifiers_rollout
from grpo.training.colocated import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Qwen3's renderer bridges a turn token-exactly; it needs the Qwen3 special tokens in the vocabulary and an unk
# token of its own (a qwen2 config makes the tokenizer's default unk <|endoftext|>, which the renderer refuses).
QWEN3_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def qwen3_model_dir(tmp_path_factory):
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"unk_token": "<unk>", "additional_special_tokens": QWEN3_TOKENS})
    path = tmp_path_factory.mktemp("tiny-qwen3-tokens")
    build_qwen2(tokenizer, hidden_size=64, num_layers=2, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def captured(monkeypatch):
    """Every rollout's rows (sampled tokens, loss mask) and the endpoint's recorded replies per episode."""
    records = []
    rollout = verifiers_rollout.VerifiersRollout.rollout

    def recording(self, *args, **kwargs):
        result = rollout(self, *args, **kwargs)
        g = result.generation
        rows = [(tuple(ids[mask.bool()].tolist()), mask.tolist()) for ids, mask in zip(g.completion_ids, g.loss_mask)]
        replies = {session: tuple(t for turn in turns for t in turn.completion_ids)
                   for session, turns in self.endpoint.sessions.items()}
        records.append((rows, replies))
        return result

    monkeypatch.setattr(verifiers_rollout.VerifiersRollout, "rollout", recording)
    return records


def overrides(model_dir, out, source, **extra) -> list[str]:
    return as_overrides({
        "model.name_or_path": model_dir, "data.train": source, "data.eval": None, "rewards": "[]",
        "rollout.num_generations": 2, "rollout.max_completion_length": 48, "train.prompts_per_step": 2,
        "train.micro_batch_size": 4, "train.max_steps": 2, "train.save_steps": 10, "train.output_dir": out,
        "log.report_to": "[]", "log.progress_bar": False, "log.plots": False, "optim.learning_rate": 1e-3, **extra})


def run(model_dir, out, source, **extra):
    train(load_config(SMOKE, overrides(model_dir, out, source, **extra)))
    return steps_of(out)


def steps_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def assert_rows_are_the_replies(captured):
    for rows, replies in captured:
        assert len(rows) == len(replies) == 4  # 2 tasks x G=2, one episode each
        assert sorted(sampled for sampled, _ in rows) == sorted(replies.values())


def test_a_single_agent_taskset_trains_on_the_sampled_tokens(tiny_model_dir, tmp_path, monkeypatch, captured):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    steps = run(tiny_model_dir, tmp_path / "run", "verifiers:vf_echo_env")
    assert [s["step"] for s in steps] == [1, 2]
    for record in steps:  # the task's two rewards, under their names, weighted 2 and 0.5
        assert 0.0 <= record["reward/has_digit"] <= 1.0 and 0.0 <= record["reward/short"] <= 1.0
        assert record["reward/mean"] == pytest.approx(2.0 * record["reward/has_digit"] + 0.5 * record["reward/short"])
        assert record["verifiers/failed_episodes"] == 0.0
    assert len(captured) == 2
    assert_rows_are_the_replies(captured)


def test_two_ranks_each_play_their_episodes_against_their_own_endpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "grpo", "train", SMOKE, *overrides(tiny_model_dir, out, "verifiers:vf_echo_env")]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = steps_of(out)
    assert [s["step"] for s in steps] == [1, 2]
    assert all("reward/has_digit" in s and s["verifiers/failed_episodes"] == 0.0 for s in steps)


def test_a_multi_turn_tool_harness_trains_replies_and_keeps_tool_results_as_context(qwen3_model_dir, tmp_path,
                                                                                    monkeypatch, captured):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    source = "verifiers:vf_tools_env,max_tokens=12,renderer=qwen3,renderer.thinking_retention=all"
    steps = run(qwen3_model_dir, tmp_path / "run", source, **{"rollout.max_completion_length": 80})
    assert [s["step"] for s in steps] == [1, 2]
    assert all("reward/digits_seen" in s and s["verifiers/failed_episodes"] == 0.0 for s in steps)
    assert_rows_are_the_replies(captured)
    for rows, _ in captured:  # two turns: a reply, the tool's result (mask 0), a reply
        for _, mask in rows:
            first_gap = mask.index(0)
            assert 1 in mask[first_gap:], "the second reply follows the tool result"


def test_two_ranks_play_multi_turn_tool_episodes(qwen3_model_dir, tmp_path):
    out = tmp_path / "run"
    source = "verifiers:vf_tools_env,max_tokens=12,renderer=qwen3,renderer.thinking_retention=all"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "grpo", "train", SMOKE, *overrides(qwen3_model_dir, out, source, **{"rollout.max_completion_length": 80})]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = steps_of(out)
    assert [s["step"] for s in steps] == [1, 2]
    assert all("reward/digits_seen" in s and s["verifiers/failed_episodes"] == 0.0 for s in steps)


def test_an_episode_that_raises_or_hangs_is_a_zero_reward_and_a_counted_warning(tiny_model_dir, tmp_path,
                                                                               monkeypatch, caplog):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    caplog.set_level(logging.WARNING, logger="grpo.multiturn.verifiers_rollout")
    steps = run(tiny_model_dir, tmp_path / "run", "verifiers:vf_failing_env,timeout_s=3",
                **{"train.prompts_per_step": 4, "rollout.max_completion_length": 8})
    assert [s["step"] for s in steps] == [1, 2]
    # each step plays all 4 tasks twice: tasks 0 and 1 fail (4 of 8 episodes), the others reply
    assert all(s["verifiers/failed_episodes"] == 0.5 and s["reward/replied"] == 0.5 for s in steps)
    failures = [r.getMessage() for r in caplog.records if r.name == "grpo.multiturn.verifiers_rollout"]
    assert len(failures) == 8 and "(8 in this run)" in failures[-1]
    assert any("the agent program crashed" in m for m in failures)
    assert any("timed out after 3 s" in m for m in failures)


def test_the_python_api_trains_on_an_environment_object_with_its_tasks_rewards(tiny_model_dir, tmp_path,
                                                                               monkeypatch, captured):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    from grpo import GRPOConfig, GRPOTrainer

    env = load_environment(resolve_env_config({"taskset": {"id": "vf_echo_env"},
                                               "agent": {"runtime": {"type": "subprocess"}}}))
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=2,
                      use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True)
    trainer = GRPOTrainer(str(tiny_model_dir), args=args, train_dataset=env)
    assert trainer.config.data.train == "verifiers:vf_echo_env" and trainer.config.rewards == []  # its own rewards
    assert trainer.train().global_step == 2
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert len(steps) == 2 and all("rewards/has_digit/mean" in e for e in steps)
    assert_rows_are_the_replies(captured)
