"""grpo.api.callbacks: log_history entries and callback events as TRL 1.16 makes them: one per optimizer update
(windows of logging_steps updates), TRL's names, the generation's metrics on the first update after it, and
evaluations under TRL's eval_ names."""

from __future__ import annotations

import math

import pytest
from transformers import TrainerCallback, TrainerControl, TrainerState

from grpo.api.callbacks import CallbackHooks, trl_eval_entries, trl_metrics, update_entries
from grpo.training.loop import StepReport


def step_metrics(step: int) -> dict:
    return {"loss": float(step), "learning_rate": 0.1 * step, "reward/mean": 1.0 * step, "reward/std": 0.5,
            "reward/judge": 2.0 * step, "reward_std/judge": 0.25, "kl": 0.01, "epoch": step / 10, "accuracy": 0.5,
            "completion_length/mean": 6.0, "completion_length/min": 2.0, "terminated_length/max": 5.0,
            "step_tokens": 100.0, "time/step_s": 3.0, "clip_fraction": 0.5, "eval/accuracy": 0.75}


def update(u: int, step: int) -> dict:
    return {"loss": 10.0 * step + u, "kl": 0.0, "entropy": 1.0, "ratio_mean": 1.0, "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": 0.1, "clip_ratio/region_mean": 0.1, "clip_ratio/low_min": 0.0,
            "clip_ratio/high_max": 0.5, "grad_norm": 1.0 + u, "learning_rate": 0.1 * step + 0.01 * u, "update_s": 0.5}


def test_trl_names_and_bessel_reward_std():
    named = trl_metrics(step_metrics(1), ["judge"], completions=4, with_kl=False)
    assert named["reward"] == 1.0 and named["rewards/judge/mean"] == 2.0 and named["rewards/judge/std"] == 0.25
    assert named["accuracy"] == 0.5 and named["completions/min_length"] == 2.0
    assert named["completions/max_terminated_length"] == 5.0
    assert math.isclose(named["reward_std"], 0.5 * math.sqrt(4 / 3)) and "kl" not in named
    # an environment's reward (not among the reward functions) is a reward by its reward_std, as TRL names it
    env = trl_metrics({"reward/Counter": 0.5, "reward_std/Counter": 0.1, "tools/calls_per_completion": 1.5,
                       "tools/failure_rate": 0.25, "sampled_length/mean": 3.0, "completion_length/mean": 9.0},
                      [], completions=4, with_kl=False)
    assert env == {"rewards/Counter/mean": 0.5, "rewards/Counter/std": 0.1, "tools/call_frequency": 1.5,
                   "tools/failure_frequency": 0.25, "completions/mean_length": 3.0}  # the model's own tokens


def test_update_entries_split_a_step_as_trl_logs_it():
    first, second = update_entries(step_metrics(2), [update(0, 2), update(1, 2)], {"reward": 2.0}, 0.1, False)
    assert first["reward"] == 2.0 and "reward" not in second  # the generation's metrics: the first update's
    assert (first["loss"], second["loss"]) == (20.0, 21.0) and second["grad_norm"] == 2.0
    assert first["step_time"] == 2.5 and second["step_time"] == 0.5  # the step's 3 s: generation + update 1
    assert (first["epoch"], second["epoch"]) == pytest.approx((0.15, 0.2))
    assert "kl" not in first and "update_s" not in first


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: self.events.append((name, state.global_step))
        return super().__getattribute__(name)


def test_two_iterations_log_and_call_back_per_update_as_trl():
    """num_iterations=2, logging_steps=1: TRL's sequence for max_steps=4 (recorded from TRL 1.16), an
    evaluation at global step 2 and the last step's checkpoint."""
    state, control, recorder = TrainerState(), TrainerControl(), Recorder()
    hooks = CallbackHooks(None, state, control, [recorder], model=None, tokenizer=None, reward_names=["judge"],
                          completions_per_step=8, updates_per_step=2, logging_steps=1, eval_rows={"": 8})
    hooks.train_begin(0, 2)
    for step in (1, 2):
        hooks.step_begin(step)
        hooks.evaluated(step, {"eval/accuracy": 0.5, "time/eval_s": 2.0})
        if step == 2:
            hooks.saved(step, None)
        hooks.step_end(step, StepReport(step_metrics(step), [update(0, step), update(1, step)], None))
    hooks.train_end(2)
    def update_events(g):  # one optimizer update from global step g (no gradient accumulation)
        return [("on_step_begin", g), ("on_pre_optimizer_step", g), ("on_optimizer_step", g), ("on_step_end", g + 1)]

    assert recorder.events == [
        ("on_train_begin", 0), ("on_epoch_begin", 0), *update_events(0), ("on_log", 1),
        *update_events(1), ("on_log", 2), ("on_log", 2), ("on_evaluate", 2),
        *update_events(2), ("on_log", 3), *update_events(3),
        ("on_log", 4), ("on_log", 4), ("on_evaluate", 4), ("on_save", 4), ("on_epoch_end", 4), ("on_log", 4),
        ("on_train_end", 4)]
    train = [e for e in state.log_history if "loss" in e]
    assert [e["step"] for e in train] == [1, 2, 3, 4]
    assert [e["num_tokens"] for e in train if "num_tokens" in e] == [100.0, 200.0]  # cumulative, as TRL's
    assert "reward" in train[0] and "reward" not in train[1] and "eval/accuracy" not in train[0]
    evaluation = [e for e in state.log_history if "eval_accuracy" in e]
    assert [(e["step"], e["eval_num_tokens"], e["eval_runtime"]) for e in evaluation] == [(2, 100.0, 2.0),
                                                                                            (4, 200.0, 2.0)]
    summary = state.log_history[-1]
    assert summary["train_loss"] == pytest.approx((10 + 11 + 20 + 21) / 4)  # the mean over updates
    assert summary["train_samples_per_second"] * summary["train_runtime"] == pytest.approx(8 * 4)


def test_windows_average_the_updates_and_leftovers_join_the_summary():
    state, control = TrainerState(), TrainerControl()
    hooks = CallbackHooks(None, state, control, [], model=None, tokenizer=None, reward_names=["judge"],
                          completions_per_step=4, updates_per_step=2, logging_steps=4)
    hooks.train_begin(0, 3)
    for step in (1, 2, 3):  # updates 1-6: one window of 4 updates (steps 1-2), step 3's two left over
        hooks.step_begin(step)
        hooks.step_end(step, StepReport(step_metrics(step), [update(0, step), update(1, step)], None))
    hooks.train_end(3)
    window, summary = state.log_history
    assert window["step"] == 4 and window["loss"] == (10 + 11 + 20 + 21) / 4 and window["reward"] == 1.5
    assert math.isclose(window["learning_rate"], 0.21) and window["num_tokens"] == 200.0  # the window's last
    assert summary["step"] == 6 and summary["reward"] == 3.0
    assert summary["train_loss"] == pytest.approx((10 + 11 + 20 + 21 + 30 + 31) / 6)
    assert state.max_steps == 6 and state.global_step == 6


def test_eval_metrics_under_trls_names():
    metrics = {"eval/accuracy": 0.5, "eval/reward/total": 1.5, "eval/reward_std/total": 0.5,
               "eval/reward/judge": 1.0, "eval/reward_std/judge": 0.1, "eval/truncated_rate": 0.25,
               "eval/completion_length/mean": 7.0, "eval/terminated_length/min": 3.0,
               "eval/accuracy/people=3": 1.0, "time/eval_s": 4.0}
    [got] = trl_eval_entries(metrics, {"": 10}, batch_size=4)
    assert got == {
        "eval_accuracy": 0.5, "eval_reward": 1.5, "eval_reward_std": 0.5, "eval_rewards/judge/mean": 1.0,
        "eval_rewards/judge/std": 0.1, "eval_completions/clipped_ratio": 0.25, "eval_completions/mean_length": 7.0,
        "eval_completions/min_terminated_length": 3.0, "eval_accuracy/people=3": 1.0, "eval_runtime": 4.0,
        "eval_samples_per_second": 2.5, "eval_steps_per_second": 0.75}  # 10 rows in 3 batches of 4, as Trainer's
    assert "test_reward" in trl_eval_entries(metrics, {"": 10}, 4, prefix="test")[0]


def test_a_dict_of_eval_sets_gives_an_entry_per_set_as_trl():
    """Trainer.evaluate with a dict: one entry per set, TRL's GRPO metrics under eval_ in each (TRL's log adds
    eval_ whatever the set), the set's runtime and grpo's own metrics under eval_<set>_ (metric_key_prefix)."""
    metrics = {"eval/easy/accuracy": 0.5, "eval/easy/reward/total": 1.5, "eval/easy/reward/judge": 1.0,
               "eval/hard/accuracy": 0.1, "eval/hard/reward/total": 0.2, "eval/hard/completion_length/max": 9.0,
               "time/eval_s": 3.0}
    easy, hard = trl_eval_entries(metrics, {"easy": 4, "hard": 2}, batch_size=4)
    assert easy == {"eval_easy_accuracy": 0.5, "eval_reward": 1.5, "eval_rewards/judge/mean": 1.0,
                    "eval_easy_runtime": 2.0, "eval_easy_samples_per_second": 2.0,
                    "eval_easy_steps_per_second": 0.5}  # 4 of the 6 rows: 2 of the 3 shared seconds
    assert hard == {"eval_hard_accuracy": 0.1, "eval_reward": 0.2, "eval_completions/max_length": 9.0,
                    "eval_hard_runtime": 1.0, "eval_hard_samples_per_second": 2.0,
                    "eval_hard_steps_per_second": 1.0}
    # the config's own data.eval (grpo_overrides), whose rows the API does not hold: the sets the metrics name
    easy, hard = trl_eval_entries(metrics, {}, batch_size=4)
    assert (easy["eval_easy_accuracy"], easy["eval_easy_runtime"], hard["eval_hard_samples_per_second"]) == (0.5, 1.5,
                                                                                                           0.0)
    [one] = trl_eval_entries({"eval/accuracy": 0.5, "eval/accuracy/people=3": 1.0}, {}, batch_size=4)
    assert one == {"eval_accuracy": 0.5, "eval_accuracy/people=3": 1.0}


def test_each_set_is_logged_and_the_best_metric_kept_as_trainer_does(tmp_path):
    """In training, each set's entry is logged and passed to on_evaluate; metric_for_best_model then reads the
    merged metrics (the last set's value of a shared name, as Trainer's), trainer_state.json names the best
    checkpoint once its folder exists, and save_total_limit keeps it (with the newest) as Trainer's rotation."""
    import types

    args = types.SimpleNamespace(metric_for_best_model="reward", greater_is_better=None)
    state, recorder = TrainerState(), Recorder()
    hooks = CallbackHooks(args, state, TrainerControl(), [recorder], model=None, tokenizer=None, reward_names=[],
                          completions_per_step=8, updates_per_step=1, logging_steps=1, write_trainer_state=True,
                          eval_rows={"easy": 4, "hard": 2}, save_total_limit=1)
    hooks.train_begin(0, 4)
    for step, (easy, hard) in zip((1, 2, 3, 4), ((0.1, 0.5), (0.9, 0.7), (0.8, 0.6), (0.0, 0.0))):
        hooks.step_begin(step)
        hooks.evaluated(step, {"eval/easy/reward/total": easy, "eval/easy/accuracy": 0.0,
                               "eval/hard/reward/total": hard, "eval/hard/accuracy": 0.0, "time/eval_s": 1.0})
        if step != 2:  # no checkpoint-2: the best step's folder is named only once it exists
            (tmp_path / f"checkpoint-{step}").mkdir()
            hooks.saved(step, tmp_path / f"checkpoint-{step}")
        hooks.step_end(step, StepReport(step_metrics(step), [], None))
    evaluations = [e for e in state.log_history if any(k.startswith("eval_") for k in e)]
    assert [(e["step"], e["eval_reward"], "eval_easy_runtime" in e) for e in evaluations[:6]] == [
        (1, 0.1, True), (1, 0.5, False), (2, 0.9, True), (2, 0.7, False), (3, 0.8, True), (3, 0.6, False)]
    assert [e for e in recorder.events if e[0] == "on_evaluate"] == [("on_evaluate", s)
                                                                     for s in (1, 1, 2, 2, 3, 3, 4, 4)]
    assert (state.best_metric, state.best_global_step) == (0.7, 2)  # hard's, the last set's
    assert state.best_model_checkpoint == str(tmp_path / "checkpoint-1")  # Trainer's: kept, checkpoint-2 never saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-4"]  # the best, the newest
    saved = TrainerState.load_from_json(str(tmp_path / "checkpoint-1" / "trainer_state.json"))
    assert (saved.best_metric, saved.best_global_step) == (0.5, 1)
    assert saved.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    hooks.train_end(4)  # Trainer's _finalize_training: save_total_limit 1 keeps the best checkpoint only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    args.metric_for_best_model = "eval_accuracy"
    with pytest.raises(KeyError, match="'eval_accuracy', which is not found in the evaluation metrics"):
        hooks.evaluated(4, {"eval/easy/accuracy": 0.0, "eval/hard/accuracy": 0.0})
    hooks.evaluated(0, {"eval/easy/accuracy": 0.0, "eval/hard/accuracy": 0.0})  # eval_on_start's: not compared


def test_the_last_step_is_evaluated_inside_it_under_trls_rule():
    """transformers' DefaultFlowCallback evaluates the last step too when it is not an eval step, inside it
    (before its checkpoint); grpo's CLI evaluates once more after the loop instead (``train.eval_at_end``)."""
    from grpo.training.schedule import Schedule

    trl = Schedule(max_steps=3, save_steps=10, eval_steps=2, eval_at_end=False)
    cli = Schedule(max_steps=3, save_steps=10, eval_steps=2, eval_at_end=True)
    assert [s for s in (1, 2, 3) if trl.evaluates(s)] == [2, 3]
    assert [s for s in (1, 2, 3) if cli.evaluates(s)] == [2]  # and step 3 once after the loop
    assert [s for s in (1, 2, 3, 4) if Schedule(max_steps=4, save_steps=10, eval_steps=2,
                                                 eval_at_end=False).evaluates(s)] == [2, 4]  # 4 once
    assert not Schedule(max_steps=3, save_steps=10, eval_at_end=False).evaluates(3)  # no eval_steps: none


def test_without_checkpoints_the_best_metric_is_kept_but_no_best_step():
    """Trainer's _determine_best_metric names best_global_step only under a saving strategy."""
    import types

    for strategy, step in (("no", None), ("steps", 1)):
        args = types.SimpleNamespace(metric_for_best_model="accuracy", greater_is_better=True, save_strategy=strategy)
        state = TrainerState()
        hooks = CallbackHooks(args, state, TrainerControl(), [], model=None, tokenizer=None, reward_names=[],
                              completions_per_step=8, updates_per_step=1, logging_steps=1)
        hooks.train_begin(0, 1)
        hooks.step_begin(1)
        hooks.evaluated(1, {"eval/accuracy": 0.25, "time/eval_s": 1.0})
        hooks.step_end(1, StepReport(step_metrics(1), [], None))
        assert (state.best_metric, state.best_global_step) == (0.25, step)
