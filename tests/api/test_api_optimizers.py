"""The optimizer arguments of TRL's GRPOConfig / GRPOTrainer as transformers' Trainer takes them: adam_epsilon,
lr_scheduler_kwargs (dict or JSON text), optim_args (parsed; AdamW takes nothing from it), and
``optimizers=(optimizer, lr_scheduler)``: the user's objects step the updates and checkpoints hold their states."""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from test_api_trainer import Recorder, args_for, digit_reward, load, rows


def test_adam_epsilon_and_lr_scheduler_kwargs_map_both_ways():
    args = GRPOConfig(max_steps=4, use_cpu=True, adam_epsilon=1e-6, lr_scheduler_type="cosine_with_min_lr",
                      lr_scheduler_kwargs='{"min_lr_rate": "0.1", "num_cycles": 0.5}')  # JSON text, as transformers
    cfg = args.to_run_config()
    assert cfg.optim.adam_epsilon == 1e-6
    assert (cfg.optim.lr_scheduler_type, cfg.optim.lr_scheduler_kwargs) == ("cosine_with_min_lr",
                                                                         {"min_lr_rate": 0.1, "num_cycles": 0.5})
    assert GRPOConfig.from_run_config(cfg).to_run_config() == cfg
    assert GRPOConfig.from_run_config(cfg).lr_scheduler_kwargs == {"min_lr_rate": 0.1, "num_cycles": 0.5}
    assert GRPOConfig().adam_epsilon == GRPOConfig(max_steps=1, use_cpu=True).to_run_config().optim.adam_epsilon
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs.*\['min_lr'\] are not arguments of the linear"):
        GRPOConfig(max_steps=4, use_cpu=True, lr_scheduler_kwargs={"min_lr": 0.0}).to_run_config()
    with pytest.raises(ValueError, match="GRPOConfig.lr_scheduler_kwargs='num_cycles=1': a dict or its JSON text"):
        GRPOConfig(lr_scheduler_kwargs="num_cycles=1")


def test_optim_args_are_parsed_as_transformers_parses_them_and_adamw_takes_nothing_from_them():
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_optimizer import _parse_optim_args

    from grpo.api.arguments import optimizer_arguments

    text = "amsgrad=True, foo = 3,bar=x"
    assert optimizer_arguments(text) == _parse_optim_args(text)
    GRPOConfig(optim_args=text)  # accepted as Trainer accepts it
    with pytest.raises(ValueError, match=r"GRPOConfig.optim_args='amsgrad'.*not key=value"):
        GRPOConfig(optim_args="amsgrad")
    # why accepting it changes nothing: transformers' AdamW kwargs are the same with and without optim_args
    for optim in ("adamw_torch", "adamw_torch_fused"):
        plain = TrainingArguments(output_dir="unused", optim=optim, use_cpu=True, report_to="none")
        given = TrainingArguments(output_dir="unused", optim=optim, optim_args=text, use_cpu=True, report_to="none")
        assert Trainer.get_optimizer_cls_and_kwargs(given) == Trainer.get_optimizer_cls_and_kwargs(plain)


def _adamw_as_grpos(model, args):
    """torch AdamW with the hyperparameters grpo's own AdamW takes from ``args`` (one group: weight decay 0)."""
    return torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=0.0)


def test_a_given_optimizer_steps_the_updates_with_the_arguments_schedule_or_its_own(tiny_model_dir, tmp_path):
    builtin = GRPOTrainer(load(tiny_model_dir), digit_reward, args_for(tmp_path / "a"), train_dataset=rows())
    builtin.train()
    # the same AdamW built by the user, no scheduler: Trainer builds the arguments' (linear) schedule over it
    model = load(tiny_model_dir)
    args = args_for(tmp_path / "b")
    optimizer = _adamw_as_grpos(model, args)
    given = GRPOTrainer(model, digit_reward, args, train_dataset=rows(), optimizers=(optimizer, None))
    given.train()
    assert given.optimizer is optimizer and optimizer.state  # it stepped: its moments exist
    want, got = builtin.model.state_dict(), given.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    rates = [e["learning_rate"] for e in given.state.log_history if "loss" in e]
    assert rates == [e["learning_rate"] for e in builtin.state.log_history if "loss" in e]
    # the user's scheduler steps instead: a zero factor leaves every weight as it was
    model = load(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = _adamw_as_grpos(model, args)
    frozen = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 0.0)
    trainer = GRPOTrainer(model, digit_reward, args_for(tmp_path / "c"), train_dataset=rows(),
                          optimizers=(optimizer, frozen))
    trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {e["learning_rate"] for e in trainer.state.log_history if "loss" in e} == {0.0}
    assert frozen.last_epoch == 4  # stepped once per update


def test_a_given_optimizers_state_is_checkpointed_and_resumed(tiny_model_dir, tmp_path):
    def trainer(out, **kwargs):
        model = load(tiny_model_dir)
        args = args_for(out)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.5, 0.9))  # not grpo's
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 / (1 + update))
        return GRPOTrainer(model, digit_reward, args, train_dataset=rows(), optimizers=(optimizer, scheduler),
                           **kwargs)

    straight = trainer(tmp_path / "a")
    straight.train()
    trainer(tmp_path / "b", callbacks=[Recorder(stop_at=2)]).train()
    saved = torch.load(tmp_path / "b" / "checkpoint-2" / "optimizer.pt", weights_only=False)
    assert saved["param_groups"][0]["betas"] == (0.5, 0.9)  # the user's optimizer's own state
    resumed = trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.lr_scheduler.last_epoch == 4  # restored at 2, stepped twice more
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)  # moments and schedule restored: the same weights


def test_optimizers_that_cannot_train_the_model_are_refused(tiny_model_dir, tmp_path):
    model = load(tiny_model_dir)
    other = torch.optim.SGD(load(tiny_model_dir).parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        ((None, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0)), ValueError,
         r"optimizers=\(None, lr_scheduler\)"),
        ((other, None), ValueError, "parameters are not the model's"),
        ((optimizer, torch.optim.lr_scheduler.LambdaLR(other, lambda u: 1.0)), ValueError, "steps another optimizer"),
        ((optimizer,), TypeError, r"a tuple \(optimizer, lr_scheduler\)"),
    ]
    for optimizers, error, match in cases:
        with pytest.raises(error, match=match):
            GRPOTrainer(model, digit_reward, args_for(tmp_path / "run"), train_dataset=rows(), optimizers=optimizers)
    with pytest.raises(ValueError, match="Passing `optimizers` is not allowed if Deepspeed is enabled"):
        GRPOTrainer(model, digit_reward, args_for(tmp_path / "run", grpo_overrides={"train.deepspeed": "ds.json"}),
                    train_dataset=rows(), optimizers=(optimizer, None))
    assert not (tmp_path / "run").exists()
