"""reasoning-gym end to end on the tiny test model: two colocated GRPO steps from a recipe on a composite source
(the reasoning_gym reward logged, in all and per dataset, and each named eval set's per-dataset accuracy), and
two steps of the Python API on a reasoning-gym dataset object with no reward_funcs (its task's rewards)."""

from __future__ import annotations

import json

import pytest

from grpo.cli import main

RECIPE = """\
model: {{name_or_path: {model}, lora_r: 0}}
data:
  train: reasoning_gym:chain_sum*2,max_digits=1+leg_counting,size=64,seed=5
  eval:
    sums: reasoning_gym:chain_sum,size=4,seed=99,max_digits=1
    mix: reasoning_gym:chain_sum+leg_counting,size=6,seed=98
rollout: {{num_generations: 4, max_completion_length: 12, temperature: 1.0}}
optim: {{learning_rate: 1.0e-3}}
train: {{prompts_per_step: 4, micro_batch_size: 16, max_steps: 2, save_steps: 2, eval_steps: 2, output_dir: {out},
        seed: 3}}
log: {{report_to: [], progress_bar: false, plots: false, logging_steps: 1}}
"""

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_recipe_on_a_composite_trains_and_logs_reward_and_accuracy_per_dataset(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    recipe = tmp_path / "rg.yaml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir, out=out))
    assert main(["train", str(recipe)]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:  # the recipe lists no rewards: the task's, the dataset's own score first
        assert 0.0 <= record["reward/reasoning_gym"] <= 1.0 and "reward/format_think_answer" in record
        assert any(key in record for key in ("reasoning_gym/chain_sum", "reasoning_gym/leg_counting"))
    evaluated = {k for r in lines for k in r if k.startswith("eval/")}
    assert {"eval/sums/accuracy", "eval/sums/accuracy/chain_sum", "eval/sums/score",
            "eval/mix/accuracy/chain_sum", "eval/mix/accuracy/leg_counting"} <= evaluated


def test_the_python_api_trains_on_a_dataset_object_with_its_tasks_rewards(tiny_model_dir, tmp_path):
    import reasoning_gym

    from grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=2,
                      use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True,
                      seed=3)
    train = reasoning_gym.create_dataset("chain_sum", size=32, seed=1, max_digits=1)
    trainer = GRPOTrainer(str(tiny_model_dir), args=args, train_dataset=train,
                          eval_dataset={"legs": reasoning_gym.create_dataset("leg_counting", size=4, seed=2)})
    assert trainer.reward_func_names == ["reasoning_gym", "format_think_answer"]
    assert trainer.config.data.task == "reasoning_gym"
    assert trainer.train().global_step == 2
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert len(steps) == 2 and all("rewards/reasoning_gym/mean" in e for e in steps)
    metrics = trainer.evaluate()  # TRL's names for a named set: eval_<set>_<grpo's metric>
    assert 0.0 <= metrics["eval_legs_accuracy/leg_counting"] <= 1.0 and "eval_legs_score" in metrics
