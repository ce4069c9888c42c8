"""grpo.api.trainer: GRPOTrainer as a TRL user drives it from Python: bad input refused before anything is
written, TRL's log names and callback events, Ctrl-C, resume, several trainers in one process, save_model."""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import DataError


def rows(n=32):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(n)]


def digit_reward(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def length_reward(completions, **kwargs):
    return [-len(c[0]["content"]) / 100 for c in completions]


def args_for(out, **kwargs):
    defaults = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                    max_steps=4, learning_rate=1e-3, logging_steps=1, save_steps=2, use_cpu=True, bf16=False,
                    gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=3)
    return GRPOConfig(**{**defaults, **kwargs})


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def test_bad_input_is_an_exception_naming_it_before_anything_is_written(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    out = tmp_path / "run"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    cases = [
        (ValueError, "does not exist", dict(model=str(tmp_path / "no-model"))),
        (ValueError, "PeftModel` instance together with a `peft_config",
         dict(model=get_peft_model(load(tiny_model_dir), lora), peft_config=lora)),
        (DataError, r"train_dataset\[0\]: no 'prompt' column", dict(train_dataset=[{"question": "?"}])),
        (ValueError, "reward 'needs_solution' cannot be called",
         dict(reward_funcs=lambda completions, solution: [0.0] * len(completions))),
        (ValueError, "reward_funcs: give at least one reward", dict(reward_funcs=[])),
        (ValueError, "peft_config.use_dora=True is not supported",
         dict(peft_config=LoraConfig(r=4, use_dora=True, task_type="CAUSAL_LM"))),
    ]
    for error, match, given in cases:
        kwargs = dict(model=str(tiny_model_dir), reward_funcs=digit_reward, args=args_for(out), train_dataset=rows())
        kwargs.update(given)
        if "reward_funcs" in given and callable(given["reward_funcs"]):
            kwargs["reward_funcs"].__name__ = "needs_solution"
        with pytest.raises(error, match=match):
            GRPOTrainer(**kwargs)
        assert not out.exists(), match
    with pytest.raises(ValueError, match="GRPOConfig.push_to_hub=True is not supported by grpo: grpo never uploads"):
        GRPOConfig(output_dir=str(out), push_to_hub=True)
    with pytest.raises(ValueError, match=r"GRPOConfig: loss.delta: 0.5 is out of range: must be > 1"):
        GRPOTrainer(str(tiny_model_dir), reward_funcs=digit_reward, args=args_for(out, delta=0.5), train_dataset=rows())
    assert not out.exists()


class Recorder:
    """A TrainerCallback (duck-typed as Trainer calls it) that records events and stops at ``stop_at``."""

    def __init__(self, stop_at=None):
        from transformers import TrainerCallback

        self.base, self.events, self.stop_at = TrainerCallback(), [], stop_at

    def __getattr__(self, event):
        def record(args, state, control, **kwargs):
            self.events.append((event, state.global_step))
            if event == "on_step_end" and state.global_step == self.stop_at:
                control.should_training_stop = True
            return control

        return record


def test_train_logs_trl_names_fires_callbacks_and_a_callback_stops_it(tiny_model_dir, tmp_path):
    model = load(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = Recorder(stop_at=3)
    trainer = GRPOTrainer(model, [digit_reward, length_reward], args_for(tmp_path / "run", save_steps=100),
                          train_dataset=rows(), callbacks=[recorder])
    output = trainer.train()
    assert trainer.model is model and trainer.state.global_step == output.global_step == 3
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # trained in place
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2, 3]
    for name in ("reward", "reward_std", "rewards/digit_reward/mean", "rewards/length_reward/mean", "entropy",
                 "completions/mean_length", "clip_ratio/region_mean", "learning_rate", "grad_norm"):
        assert all(name in e for e in steps), name
    assert "kl" not in steps[0]  # beta 0: TRL logs no kl
    assert "train_runtime" in trainer.state.log_history[-1]
    names = [event for event, _ in recorder.events]
    assert names[:2] == ["on_init_end", "on_train_begin"]
    # Trainer closes the epoch when a callback stops it; grpo's stop checkpoint comes after (Trainer's saves nothing)
    assert names[-4:] == ["on_epoch_end", "on_save", "on_log", "on_train_end"]
    assert names[2:9] == ["on_epoch_begin", "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step",
                          "on_step_end", "on_log", "on_step_begin"]
    assert ("on_save", 3) in recorder.events  # stopping writes the step's checkpoint first
    assert (tmp_path / "run" / "checkpoint-3" / "trainer_state.json").is_file()  # TRL's layout


def test_ctrl_c_saves_the_last_finished_step_and_returns(tiny_model_dir, tmp_path):
    calls = []

    def interrupting(completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return [0.0] * len(completions)

    trainer = GRPOTrainer(str(tiny_model_dir), interrupting, args_for(tmp_path / "run", save_steps=100),
                          train_dataset=rows())
    output = trainer.train()  # returns: a notebook keeps its kernel and its trainer
    assert output.global_step == 2
    assert (tmp_path / "run" / "checkpoint-2").is_dir()


def test_resume_equals_an_uninterrupted_run_with_three_trainers_in_one_process(tiny_model_dir, tmp_path):
    straight = GRPOTrainer(load(tiny_model_dir), digit_reward, args_for(tmp_path / "a"), train_dataset=rows())
    straight.train()
    first = GRPOTrainer(load(tiny_model_dir), digit_reward, args_for(tmp_path / "b"), train_dataset=rows(),
                        callbacks=[Recorder(stop_at=2)])
    first.train()
    resumed = GRPOTrainer(load(tiny_model_dir), digit_reward, args_for(tmp_path / "b"), train_dataset=rows())
    output = resumed.train(resume_from_checkpoint=True)
    assert output.global_step == 4
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "elsewhere"))


def test_peft_config_trains_an_adapter_that_save_model_writes_loadably(tiny_model_dir, tmp_path):
    from peft import LoraConfig, PeftModel

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(load(tiny_model_dir), [digit_reward, length_reward], args_for(tmp_path / "run", max_steps=2),
                          train_dataset=rows(), peft_config=lora)
    assert trainer.config.model.lora_r == 4
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "tokenizer_config.json").exists()
    loaded = PeftModel.from_pretrained(load(tiny_model_dir), tmp_path / "adapter")
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_B" in k}
    assert trained and all(torch.equal(v, loaded.state_dict()[k]) for k, v in trained.items())
    assert any(v.abs().sum() > 0 for v in trained.values())  # lora_B starts at 0: it learned


def test_a_reward_returning_the_wrong_count_is_an_exception_naming_it(tiny_model_dir, tmp_path):
    from grpo.rewards import RewardError

    def one_short(completions, **kwargs):
        return [0.0] * (len(completions) - 1)

    trainer = GRPOTrainer(str(tiny_model_dir), one_short, args_for(tmp_path / "run"), train_dataset=rows())
    with pytest.raises(RewardError, match="one_short"):
        trainer.train()


def test_grpos_own_data_without_reward_funcs_gets_the_tasks_rewards(tiny_model_dir, tmp_path, monkeypatch):
    """TRL needs reward_funcs; with grpo's data (grpo_overrides' data.train) or a dataset and none, the run's task
    gives them (K&K: kk_logic), as a recipe without rewards gets them, and the system prompt evaluate() renders is
    the task's."""
    from grpo.tasks import resolve_task

    kk = {"data.train": "kk:seed=1,n=16,people=2"}
    trainer = GRPOTrainer(str(tiny_model_dir), args=args_for(tmp_path / "run", grpo_overrides=kk))
    assert trainer.reward_func_names == ["kk_logic"] and trainer.reward_weights == [1.0]
    assert [(r.name, r.weight) for r in trainer.config.rewards] == [("kk_logic", 1.0)]
    listed = {**kk, "rewards": [{"name": "format_think_answer", "weight": 0.5}]}
    trainer = GRPOTrainer(str(tiny_model_dir), args=args_for(tmp_path / "run", grpo_overrides=listed))
    assert trainer.reward_func_names == ["format_think_answer"] and trainer.reward_weights == [0.5]
    with pytest.raises(ValueError, match="reward_weights is set but reward_funcs is None"):
        GRPOTrainer(str(tiny_model_dir), args=args_for(tmp_path / "run", grpo_overrides=kk, reward_weights=[1.0]))
    # a dataset of TRL's rows: its task (gsm8k by default: a number in the answer column) gives them too
    trainer = GRPOTrainer(str(tiny_model_dir), args=args_for(tmp_path / "run"), train_dataset=rows())
    assert trainer.reward_func_names == ["answer_correct", "format_think_answer"]

    seen = {}

    def recording_evaluate(model, tokenizer, examples, **kwargs):
        seen.update(kwargs)
        raise StopIteration  # enough: the call's arguments are what this test reads

    monkeypatch.setattr("grpo.training.evaluator.evaluate_records", recording_evaluate)
    trainer = GRPOTrainer(str(tiny_model_dir), args=args_for(tmp_path / "run", grpo_overrides=kk))
    with pytest.raises(StopIteration):
        trainer.evaluate(rows(2))
    assert seen["system_prompt"] == resolve_task("kk").system_prompt("think")


def test_evaluate_scores_as_a_run_does_with_samples_rewards_and_named_sets(tiny_model_dir, tmp_path):
    """evaluate() before training is the run's evaluation (grpo.training.evaluator): greedy accuracy, the
    rewards' means and stds, lengths and, with eval.num_samples, pass@k, for each named set, under TRL's names."""
    trainer = GRPOTrainer(str(tiny_model_dir), reward_funcs=[digit_reward, length_reward], train_dataset=rows(),
                          eval_dataset={"easy": rows(4), "more": rows(6)},
                          args=args_for(tmp_path / "run", grpo_overrides={"eval.num_samples": 2}))
    metrics = trainer.evaluate()
    easy, more = trainer.state.log_history[-2:]  # an entry per set, as Trainer.evaluate logs a dict of sets
    for name, entry in (("easy", easy), ("more", more)):
        for key in ("accuracy", "format_rate", "pass@2", "mean@2", "runtime", "samples_per_second",
                    "steps_per_second"):
            assert f"eval_{name}_{key}" in entry and f"eval_{name}_{key}" in metrics, (name, key, sorted(entry))
        for key in ("rewards/digit_reward/mean", "rewards/length_reward/std", "reward", "reward_std",
                    "completions/mean_length", "num_tokens", "entropy", "frac_reward_zero_std",
                    "clip_ratio/region_mean"):  # TRL's own: eval_ in each set's entry
            assert f"eval_{key}" in entry, (name, key, sorted(entry))
        assert entry["eval_clip_ratio/region_mean"] == 0.0  # the loss pass's ratio is 1: nothing clipped
        assert f"eval_{name}_loss" in entry and "eval_loss" not in entry  # the set's loss: Trainer's prefix
    assert more["eval_rewards/length_reward/mean"] <= 0  # the reward itself, not a stand-in
    assert metrics["eval_reward"] == more["eval_reward"]  # merged as Trainer's: the last set's value
    assert easy["eval_easy_accuracy"] == metrics["eval_easy_accuracy"] and "eval_more_accuracy" not in easy
    one = trainer.evaluate(rows(4), metric_key_prefix="test")
    assert "test_loss" in one
    assert one["test_accuracy"] == metrics["eval_easy_accuracy"]  # greedy: the same 4 problems, the same score
    assert not (tmp_path / "run").exists()  # evaluation writes nothing


def test_two_iterations_log_per_update_and_evaluate_only_at_eval_steps_as_trl(tiny_model_dir, tmp_path):
    """num_iterations=2, logging_steps=1, eval_steps=2 over 4 updates: TRL 1.16 logs global steps 1-4, fires the
    step events per update, evaluates at 2 and 4 (no extra evaluation after the last) under eval_ names; the
    event sequence below is the one TRL 1.16 gives for the same script (its on_save at 4: the last step)."""
    recorder = Recorder()
    trainer = GRPOTrainer(str(tiny_model_dir), [digit_reward, length_reward],
                          args_for(tmp_path / "run", num_iterations=2, save_steps=100, eval_strategy="steps",
                                   eval_steps=2, per_device_eval_batch_size=8),
                          train_dataset=rows(), eval_dataset=rows(4), callbacks=[recorder])
    trainer.train()
    events = [e for e in recorder.events if e[0] not in ("on_init_end",)]
    def update_events(g):  # one optimizer update from global step g (no gradient accumulation)
        return [("on_step_begin", g), ("on_pre_optimizer_step", g), ("on_optimizer_step", g), ("on_step_end", g + 1)]

    assert events == [
        ("on_train_begin", 0), ("on_epoch_begin", 0), *update_events(0), ("on_log", 1),
        *update_events(1), ("on_log", 2), ("on_log", 2), ("on_evaluate", 2),
        *update_events(2), ("on_log", 3), *update_events(3),
        ("on_log", 4), ("on_log", 4), ("on_evaluate", 4), ("on_save", 4), ("on_epoch_end", 4), ("on_log", 4),
        ("on_train_end", 4)]
    history = trainer.state.log_history
    train = [e for e in history if "loss" in e]
    assert [e["step"] for e in train] == [1, 2, 3, 4]
    generation = ("reward", "reward_std", "rewards/digit_reward/std", "completions/min_length", "num_tokens",
                  "completions/mean_terminated_length", "frac_reward_zero_std")
    per_update = ("loss", "grad_norm", "learning_rate", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min",
                  "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean", "step_time", "epoch")
    for entry in train:
        assert all(k in entry for k in per_update), sorted(set(per_update) - set(entry))
        assert all((k in entry) == (entry["step"] % 2 == 1) for k in generation), entry["step"]
    assert train[0]["learning_rate"] > train[1]["learning_rate"]  # each update's own rate
    assert train[2]["num_tokens"] > train[0]["num_tokens"]  # cumulative
    evaluations = [e for e in history if "eval_reward" in e]
    assert [e["step"] for e in evaluations] == [2, 4]
    for key in ("eval_reward_std", "eval_rewards/digit_reward/mean", "eval_rewards/length_reward/std",
                "eval_completions/mean_length", "eval_completions/clipped_ratio", "eval_runtime",
                "eval_samples_per_second", "eval_steps_per_second", "eval_num_tokens", "eval_accuracy"):
        assert all(key in e for e in evaluations), key


def test_steps_per_generation_updates_several_times_per_generation_as_trl(tiny_model_dir, tmp_path):
    """GSPO's recipe in TRL's paper index (steps_per_generation=4, gradient_accumulation_steps=1) over 8 updates:
    2 generations of 4 updates each (grpo: 2 steps of train.mini_batches 4); global_step, the checkpoints and the
    log count updates as TRL's, the generation's metrics join the first update after it, each update steps the
    schedule (the TRL run of the same recipe: tests/trl_scripts/scripts/gspo_steps_per_generation.py)."""
    recorder = Recorder()
    args = args_for(tmp_path / "run", per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    steps_per_generation=4, importance_sampling_level="sequence", beta=0.0, epsilon=3e-4,
                    epsilon_high=4e-4, max_steps=8, save_steps=4, lr_scheduler_type="linear")
    trainer = GRPOTrainer(str(tiny_model_dir), [length_reward], args, train_dataset=rows(), callbacks=[recorder])
    assert trainer.train().global_step == 8
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert [e for e in recorder.events if e[0] == "on_step_end"] == [("on_step_end", g) for g in range(1, 9)]
    train = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 9))
    assert [("reward" in e) for e in train] == [True, False, False, False] * 2  # a generation every 4 updates
    rates = [e["learning_rate"] for e in train]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == 8  # linear decay, a step per update
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-3 / 8)  # over 8 updates, not 2
