"""TRL's evaluation arguments beyond eval_steps: num_generations_eval (the loss pass's completions per prompt)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from test_api_trainer import args_for, load, rows


def test_num_generations_eval_is_the_loss_pass_group_size_as_trls(tiny_model_dir, tmp_path):
    groups: list[set[int]] = []

    def recording(completions, prompts, **kwargs):  # each call's completions per prompt
        groups.append(set(Counter(str(p) for p in prompts).values()))
        return [0.0] * len(completions)

    for eval_generations, want in ((2, {1, 2}), (None, {1, 4})):  # 1: the greedy evaluation's; None: num_generations
        groups.clear()
        args = args_for(tmp_path / "run", num_generations_eval=eval_generations, per_device_eval_batch_size=8)
        assert args.to_run_config().eval.num_generations == eval_generations
        trainer = GRPOTrainer(load(tiny_model_dir), recording, args, train_dataset=rows(), eval_dataset=rows(4))
        trainer.evaluate()
        assert set().union(*groups) == want, groups
    cfg = args_for(tmp_path / "run", num_generations_eval=2).to_run_config()
    assert GRPOConfig.from_run_config(cfg).to_run_config() == cfg


def test_the_eval_batch_must_hold_whole_groups_as_trl_requires():
    trl = pytest.importorskip("trl")
    kwargs = dict(per_device_train_batch_size=8, num_generations=4, num_generations_eval=3, eval_strategy="steps",
                  eval_steps=1, per_device_eval_batch_size=8, use_cpu=True, max_steps=2, report_to="none")
    match = (r"global eval batch size \(8 \* 1\) must be divisible by the number of generations used for "
             r"evaluation \(3\)")
    with pytest.raises(ValueError, match=match):
        trl.GRPOConfig(output_dir="unused", **kwargs)
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs).to_run_config()
    GRPOConfig(**{**kwargs, "eval_strategy": "no"}).to_run_config()  # TRL checks it only when evaluating


def test_eval_num_generations_needs_the_loss_pass():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.num_generations is set but eval.loss_pass is false"):
        load_config(None, ["eval.num_generations=2"])
    assert load_config(None, ["eval.num_generations=2", "eval.loss_pass=true"]).eval.num_generations == 2


def _trainer_decisions(strategies: dict, max_steps: int, per_epoch: int, every: dict) -> dict[str, list[int]]:
    """The global steps at which transformers' DefaultFlowCallback has Trainer log, evaluate and save (one update per
    step): on_step_end at each step, on_epoch_end after each epoch's last step and where training stops."""
    import types

    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import DefaultFlowCallback

    args = types.SimpleNamespace(logging_first_step=False, eval_delay=0, logging_strategy=strategies["logging"],
                                 eval_strategy=strategies["eval"], save_strategy=strategies["save"])
    state = TrainerState(max_steps=max_steps, logging_steps=every["logging"], eval_steps=every["eval"],
                         save_steps=every["save"])
    flow, done = DefaultFlowCallback(), {"log": [], "evaluate": [], "save": []}
    for step in range(1, max_steps + 1):
        state.global_step, state.epoch = step, step / per_epoch
        control = flow.on_step_end(args, state, TrainerControl())
        if step % per_epoch == 0 or control.should_training_stop:
            control = flow.on_epoch_end(args, state, control)
        for name, flag in (("log", control.should_log), ("evaluate", control.should_evaluate),
                           ("save", control.should_save)):
            if flag:
                done[name].append(step)
    return done


@pytest.mark.parametrize("save, eval_, logging", [
    ("epoch", "epoch", "epoch"), ("no", "steps", "no"), ("steps", "epoch", "steps"), ("epoch", "no", "steps"),
    ("no", "epoch", "epoch"),
])
@pytest.mark.parametrize("max_steps, per_epoch", [(9, 3), (8, 3), (2, 5)])  # whole epochs, a part, none whole
def test_the_schedule_decides_as_trainers_default_flow(save, eval_, logging, max_steps, per_epoch):
    from grpo.training.schedule import Schedule

    every = {"save": 4, "eval": 2, "logging": 3}
    want = _trainer_decisions({"save": save, "eval": eval_, "logging": logging}, max_steps, per_epoch, every)
    schedule = Schedule(max_steps=max_steps, save_steps=every["save"], eval_steps=every["eval"], eval_at_end=False,
                        logging_steps=every["logging"], num_samples=1, save_strategy=save,
                        eval_strategy=eval_, logging_strategy=logging, steps_per_epoch=per_epoch)
    steps = range(1, max_steps + 1)
    assert [s for s in steps if schedule.checkpoints(s)] == want["save"]
    assert [s for s in steps if schedule.evaluates(s)] == want["evaluate"]
    assert [s for s in steps if schedule.writes_samples(s)] == want["log"]
    assert schedule.saves is (save != "no")


def test_an_epoch_strategy_needs_an_epoch_of_data_and_epoch_evaluation_no_eval_steps():
    from grpo.config import ConfigError, load_config
    from grpo.training.settings import loop_schedule

    cfg = load_config(None, ["train.save_strategy=epoch", "train.prompts_per_step=4"])
    assert loop_schedule(cfg, 10).steps_per_epoch == 2  # TRL's count: the 2 prompts left over make no step
    with pytest.raises(ConfigError, match="train.save_strategy is epoch: .* 3 prompts do not fill one step's 4"):
        loop_schedule(cfg, 3)
    assert loop_schedule(load_config(None, ["train.prompts_per_step=4"]), 3).steps_per_epoch is None
    with pytest.raises(ConfigError, match="train.eval_steps is 5 but train.eval_strategy is epoch"):
        load_config(None, ["train.eval_strategy=epoch", "train.eval_steps=5"])
    # YAML 1.1 reads a bare `no` as false: a strategy takes it as "no"; a bool key keeps refusing a word
    assert load_config(None, ["train.save_strategy=no", "log.logging_strategy=no"]).train.save_strategy == "no"
    with pytest.raises(ConfigError, match="train.load_best_at_end needs train.best_metric"):
        load_config(None, ["train.load_best_at_end=true"])


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_epoch_strategies_act_at_epoch_ends_in_trainers_order_and_the_best_checkpoint_is_loaded(tiny_model_dir,
                                                                                                 tmp_path):
    """6 prompts, 2 per step: an epoch is 3 steps, 2 epochs 6. Trainer's sequence at an epoch's end: the update's
    events, on_epoch_end, then the epoch strategies' log, evaluation and checkpoint. The random model answers
    nothing right: every evaluation's accuracy ties at 0, so the first (step 3) stays the best and its checkpoint's
    weights are loaded at the end."""
    from test_api_trainer import Recorder, length_reward

    recorder = Recorder()
    out = tmp_path / "run"
    args = args_for(out, max_steps=-1, num_train_epochs=2, save_strategy="epoch", eval_strategy="epoch",
                    logging_strategy="epoch", per_device_eval_batch_size=8, load_best_model_at_end=True,
                    metric_for_best_model="accuracy", save_final_model=True)
    trainer = GRPOTrainer(load(tiny_model_dir), length_reward, args, train_dataset=rows(6), eval_dataset=rows(4),
                          callbacks=[recorder])
    trainer.train()

    def update_events(g):
        return [("on_step_begin", g), ("on_pre_optimizer_step", g), ("on_optimizer_step", g), ("on_step_end", g + 1)]

    def epoch_end(g):
        return [("on_epoch_end", g), ("on_log", g), ("on_log", g), ("on_evaluate", g), ("on_save", g)]

    events = [e for e in recorder.events if e[0] != "on_init_end"]
    assert events == [("on_train_begin", 0), ("on_epoch_begin", 0), *update_events(0), *update_events(1),
                      *update_events(2), *epoch_end(3), ("on_epoch_begin", 3), *update_events(3), *update_events(4),
                      *update_events(5), *epoch_end(6), ("on_log", 6), ("on_train_end", 6)]
    history = trainer.state.log_history
    assert [(e["step"], e["epoch"]) for e in history if "loss" in e] == [(3, 1.0), (6, 2.0)]  # a window per epoch
    assert [e["step"] for e in history if "eval_reward" in e] == [3, 6]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    state = trainer.state
    assert (state.best_metric, state.best_global_step) == (0.0, 3)
    assert state.best_model_checkpoint == str(out / "checkpoint-3")
    best, last = _weights(out / "checkpoint-3"), _weights(out / "checkpoint-6")
    assert any(not torch.equal(best[k], last[k]) for k in best)  # training moved the weights after step 3
    model = trainer.model.state_dict()
    assert all(torch.equal(model[k], best[k]) for k in best)  # ... and the run ends with step 3's
    final = _weights(out / "final")
    assert all(torch.equal(final[k], best[k]) for k in best)  # final/ is written after the load, as save_model()


def test_save_strategy_no_writes_no_checkpoint_and_logging_no_no_training_entry(tiny_model_dir, tmp_path):
    from test_api_trainer import Recorder

    out = tmp_path / "run"
    recorder = Recorder(stop_at=2)  # a callback's stop saves nothing either
    trainer = GRPOTrainer(load(tiny_model_dir), constant, args_for(out, save_strategy="no", logging_strategy="no"),
                          train_dataset=rows(), callbacks=[recorder])
    output = trainer.train()
    assert output.global_step == 2 and not list(out.glob("checkpoint-*"))
    assert not any(e[0] == "on_save" for e in recorder.events)
    assert [e for e in trainer.state.log_history if "loss" in e] == []  # only the summary, unlogged steps merged
    assert "train_runtime" in trainer.state.log_history[-1] and "reward" in trainer.state.log_history[-1]


def test_load_best_model_at_end_takes_transformers_defaults_and_checks():
    args = GRPOConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=5, save_steps=10)
    assert (args.metric_for_best_model, args.greater_is_better) == ("loss", False)
    assert GRPOConfig(metric_for_best_model="accuracy").greater_is_better is True
    with pytest.raises(ValueError, match="requires the save and eval strategy to match"):
        GRPOConfig(load_best_model_at_end=True, eval_strategy="epoch")
    with pytest.raises(ValueError, match="round multiple of the evaluation steps, but found 10, which is not a round "
                                         "multiple of 4"):
        GRPOConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=4, save_steps=10)
    trl = pytest.importorskip("trl")
    for kwargs in (dict(eval_strategy="epoch"), dict(eval_strategy="steps", eval_steps=4, save_steps=10)):
        with pytest.raises(ValueError, match="--load_best_model_at_end requires"):  # TRL refuses the same
            trl.GRPOConfig(output_dir="unused", load_best_model_at_end=True, use_cpu=True, report_to="none", **kwargs)
