"""grpo.api.callbacks: log_history entries as TRL builds them (windows of logging_steps updates, TRL's names)."""

from __future__ import annotations

import math

from transformers import TrainerControl, TrainerState

from grpo.api.callbacks import CallbackHooks, trl_metrics


def step_metrics(step: int) -> dict:
    return {"loss": float(step), "learning_rate": 0.1 * step, "reward/mean": 1.0 * step, "reward/std": 0.5,
            "reward/judge": 2.0 * step, "kl": 0.01, "epoch": step / 10, "accuracy": 0.5}


def test_trl_names_and_bessel_reward_std():
    named = trl_metrics(step_metrics(1), ["judge"], completions=4, with_kl=False)
    assert named["reward"] == 1.0 and named["rewards/judge/mean"] == 2.0 and named["accuracy"] == 0.5
    assert math.isclose(named["reward_std"], 0.5 * math.sqrt(4 / 3)) and "kl" not in named


def test_windows_average_the_steps_and_leftovers_join_the_summary():
    state, control = TrainerState(), TrainerControl()
    hooks = CallbackHooks(None, state, control, [], model=None, tokenizer=None, reward_names=["judge"],
                          completions_per_step=4, updates_per_step=2, logging_steps=4)
    hooks.train_begin(0, 3)
    for step in (1, 2, 3):  # updates 2, 4, 6: one window of 4 updates (steps 1-2), step 3 left over
        hooks.step_begin(step)
        hooks.step_end(step, step_metrics(step))
    hooks.train_end(3)
    window, summary = state.log_history
    assert window["step"] == 4 and window["loss"] == 1.5 and window["reward"] == 1.5
    assert math.isclose(window["learning_rate"], 0.2)  # TRL logs the window's last learning rate
    assert summary["step"] == 6 and summary["reward"] == 3.0 and summary["train_loss"] == 2.0
    assert state.max_steps == 6 and state.global_step == 6
