"""A real ``grpo train`` with reward functions written for TRL: the Unsloth five as users copy them, TRL's
own ``think_format_reward`` / ``accuracy_reward`` (the gold read from ``answer`` through a column
mapping) and ``get_soft_overlong_punishment`` (built by its factory), a curriculum reward that reads
``trainer_state`` and logs through ``log_metric`` / ``log_extra``, and an async one. Every function
must score every sample of every step; a reward that cannot take TRL's call exits 2."""

from __future__ import annotations

import pytest
from run_helpers import read_jsonl, train_rows

from grpo.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 2

RECIPE = """\
data:
  tag_style: reasoning
rollout:
  num_generations: 4
  max_completion_length: 12
train:
  prompts_per_step: 2
  micro_batch_size: 4
  max_steps: 2
  seed: 0
log:
  report_to: []
  progress_bar: false
  plots: false
  num_samples: 8
rewards:
  - unsloth_rewards:correctness_reward_func
  - unsloth_rewards:int_reward_func
  - unsloth_rewards:strict_format_reward_func
  - unsloth_rewards:soft_format_reward_func
  - unsloth_rewards:xmlcount_reward_func
  - unsloth_rewards:length_curriculum
  - unsloth_rewards:async_length
  - {name: 'unsloth_rewards:make_keyword_bonus', factory_args: {keyword: '4', bonus: 0.1}}
  - trl.rewards:think_format_reward
  - {name: 'trl.rewards:accuracy_reward', columns: {solution: answer}}
  - {name: 'trl.rewards:get_soft_overlong_punishment', factory_args: {max_completion_len: 12, soft_punish_cache: 4}}
"""
NAMES = ["correctness_reward_func", "int_reward_func", "strict_format_reward_func", "soft_format_reward_func",
         "xmlcount_reward_func", "length_curriculum", "async_length", "keyword_bonus", "think_format_reward",
         "accuracy_reward", "soft_overlong_punishment_reward"]


def test_trl_style_rewards_score_every_sample_of_a_real_run(tiny_model_dir, gsm8k_dir, tmp_path):
    pytest.importorskip("trl.rewards")
    recipe = tmp_path / "trl-rewards.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "run"
    assert main(["train", str(recipe), f"model.name_or_path={tiny_model_dir}", f"train.output_dir={out}",
                 f"data.train={gsm8k_dir / 'train.jsonl'}", "data.train_limit=8"]) == 0

    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for name in NAMES:
            assert row[f"reward/{name}"] is not None, f"step {row['step']}: {name} scored nothing"
    # trainer_state.global_step / max_steps as the curriculum saw it: 0/2 at step 1, 1/2 at step 2
    assert [r["curriculum/progress"] for r in rows] == [0.0, 0.5]

    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == STEPS * 8
    for sample in samples:
        missing = [name for name in NAMES if sample["rewards"][name] is None]
        assert not missing, f"step {sample['step']}: {missing} abstained on {sample['completion']!r}"
        # log_extra columns: the curriculum's token counts and accuracy_reward's parsed gold
        assert sample["extras"]["num_tokens"] >= 1 and sample["extras"]["solution"] == sample["answer"]


def test_a_reward_that_cannot_take_trls_call_exits_2_before_anything_is_written(tiny_model_dir, tmp_path, capsys):
    # rewards_for_reliability is importable: tests/reliability is on the path (conftest.py, run_helpers.REWARD_DIRS)
    out = tmp_path / "run"
    status = main(["train", f"model.name_or_path={tiny_model_dir}", f"train.output_dir={out}",
                   "data.train=synthetic:seed=1,n=8", "train.max_steps=1", "log.report_to=[]",
                   "rewards=[{name: 'rewards_for_reliability:positional_only'}]"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "rewards_for_reliability:positional_only" in err and "cannot be called with the keywords" in err, err
    assert "**kwargs" in err  # says how rewards are called
    assert not out.exists()  # refused before the run folder was claimed
