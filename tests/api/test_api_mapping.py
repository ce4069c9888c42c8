"""grpo.api.arguments / grpo.api.mapping: TRL's GRPOConfig names, defaults and batch arithmetic mapped onto the
config tree ``grpo train`` runs, what grpo does not implement refused by name, and recipes both ways."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from grpo import GRPOConfig
from grpo.api.trl_fields import ACCEPTED_AS_IS, UNSUPPORTED
from grpo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def run_config(**kwargs):
    kwargs.setdefault("use_cpu", True)
    return GRPOConfig(**kwargs).to_run_config()


def test_trl_batch_arithmetic_gives_the_same_prompts_and_updates():
    # TRL: B x processes x GA completions per generation (steps_per_generation = GA), G per prompt
    cfg = run_config(per_device_train_batch_size=8, num_generations=8, max_steps=10)
    assert (cfg.train.prompts_per_step, cfg.train.micro_batch_size, cfg.train.max_steps) == (1, 8, 10)
    cfg = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=4,
                     max_steps=6, use_cpu=True).to_run_config(num_processes=2)
    assert (cfg.train.prompts_per_step, cfg.train.micro_batch_size) == (8, 4)
    # TRL counts every update of num_iterations as a step; a grpo step is the rollout and its updates
    cfg = run_config(max_steps=10, num_iterations=2, save_steps=4, logging_steps=2)
    assert (cfg.train.max_steps, cfg.loss.num_iterations, cfg.train.save_steps, cfg.log.logging_steps) == (5, 2, 2, 1)
    with pytest.raises(ValueError, match="max_steps=9 is not a multiple of num_iterations 2"):
        run_config(max_steps=9, num_iterations=2)
    with pytest.raises(ValueError, match="not divisible by num_generations 3"):
        run_config(per_device_train_batch_size=8, num_generations=3, max_steps=1)


GSPO = dict(importance_sampling_level="sequence", beta=0.0, epsilon=3e-4, epsilon_high=4e-4,
            gradient_accumulation_steps=1, steps_per_generation=4)  # TRL's paper index: GSPO's recipe


def test_gspo_recipe_splits_each_generation_into_four_updates():
    cfg = run_config(max_steps=8, save_steps=4, logging_steps=2, **GSPO)
    # TRL: a generation of B=8 x 1 process x 4 steps = 32 completions, 4 prompts of G=8; an update every
    # GA=1 micro-batch of 8, so 4 updates per generation and 8 updates = 2 generations
    assert (cfg.train.prompts_per_step, cfg.rollout.num_generations, cfg.train.micro_batch_size) == (4, 8, 8)
    assert (cfg.train.mini_batches, cfg.train.max_steps, cfg.train.save_steps, cfg.log.logging_steps) == (4, 2, 1, 1)
    assert (cfg.loss.importance_sampling_level, cfg.loss.beta, cfg.loss.epsilon, cfg.loss.epsilon_high) == (
        "sequence", 0.0, 3e-4, 4e-4)
    with pytest.raises(ValueError, match=r"max_steps=6 is not a multiple of the updates per generation 4"):
        run_config(max_steps=6, **GSPO)
    # num_iterations passes over each generation: 2 x 4 updates per step
    cfg = run_config(max_steps=16, num_iterations=2, **GSPO)
    assert (cfg.train.max_steps, cfg.loss.num_iterations, cfg.train.mini_batches) == (2, 2, 4)


@pytest.mark.parametrize("shape", [dict(steps_per_generation=4), dict(generation_batch_size=64),
                                   dict(gradient_accumulation_steps=2, steps_per_generation=4),
                                   dict(gradient_accumulation_steps=2, generation_batch_size=64),
                                   dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=6),
                                   dict(gradient_accumulation_steps=3)])
def test_generation_arithmetic_is_trls(shape):
    trl = pytest.importorskip("trl")
    ours = run_config(max_steps=24, **shape)
    theirs = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to="none", max_steps=24, **shape)
    assert ours.train.prompts_per_step * ours.rollout.num_generations == theirs.generation_batch_size
    # TRL updates every gradient_accumulation_steps of its steps_per_generation slices of a generation
    assert ours.train.mini_batches == theirs.steps_per_generation // theirs.gradient_accumulation_steps
    assert ours.train.micro_batch_size == theirs.per_device_train_batch_size


@pytest.mark.parametrize("kwargs, error", [
    (dict(steps_per_generation=4, generation_batch_size=32), "can not be both configured at the same time"),
    (dict(generation_batch_size=36), r"generation_batch_size \(36\) must be divisible by the global batch size \(8\)"),
    (dict(gradient_accumulation_steps=2, steps_per_generation=3),
     "steps_per_generation=3 is not supported.*must be a multiple of gradient_accumulation_steps"),
    (dict(gradient_accumulation_steps=4, steps_per_generation=2), "steps_per_generation=2 is not supported"),
    (dict(per_device_train_batch_size=4, steps_per_generation=4), "4 completions per update.*not whole groups"),
])
def test_generation_shapes_grpo_cannot_run_are_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=error):
        run_config(max_steps=8, **kwargs)


def test_mini_batches_round_trip_through_trls_arguments():
    cfg = run_config(max_steps=8, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
                     steps_per_generation=4, save_steps=4)
    assert (cfg.train.prompts_per_step, cfg.train.mini_batches, cfg.train.max_steps, cfg.train.save_steps) == (
        4, 2, 4, 2)
    args = GRPOConfig.from_run_config(cfg)
    assert (args.steps_per_generation, args.gradient_accumulation_steps, args.max_steps, args.save_steps) == (
        4, 2, 8, 4)
    assert "train.mini_batches" not in args.grpo_overrides
    assert args.to_run_config() == cfg


def test_epochs_count_steps_as_trl_does():
    # TRL probe (N=20, B=8, GA=1, G=4, one epoch): 10 steps of 2 prompts; leftover prompts are dropped
    args = GRPOConfig(per_device_train_batch_size=8, num_generations=4, num_train_epochs=1, use_cpu=True)
    assert args.to_run_config(train_size=20).train.max_steps == 10
    assert args.to_run_config(train_size=21).train.max_steps == 10
    with pytest.raises(ValueError, match="max_steps=-1 counts steps from num_train_epochs"):
        args.to_run_config()


def test_warmup_steps_is_a_count_or_a_ratio_rounded_up():
    assert run_config(max_steps=10, warmup_steps=3).optim.warmup_ratio == pytest.approx(0.3)
    assert run_config(max_steps=10, warmup_steps=0.05).optim.warmup_ratio == pytest.approx(0.1)  # ceil(0.5) = 1
    assert run_config(max_steps=10, warmup_steps=3, lr_scheduler_type="constant").optim.warmup_ratio == 0


def test_trl_values_map_to_grpo_keys():
    cfg = run_config(max_steps=4, learning_rate=3e-6, beta=0.04, loss_type="bnpo",
                     scale_rewards=False, top_k=0, min_p=None, max_grad_norm=0, report_to="none", optim="adamw_torch",
                     generation_kwargs={"min_new_tokens": 2}, output_dir=None)
    assert cfg.loss.kl_times_ratio  # TRL's use_bias_correction_kl default
    assert (cfg.optim.learning_rate, cfg.loss.beta, cfg.loss.loss_type, cfg.loss.scale_rewards) == (3e-6, 0.04, "bnpo",
                                                                                                 "none")
    assert (cfg.rollout.top_k, cfg.rollout.min_p, cfg.optim.max_grad_norm, cfg.log.report_to) == (None, 0.0, None, [])
    assert (cfg.rollout.min_new_tokens, cfg.train.output_dir, cfg.model.bf16, cfg.train.device) == (
        2, "trainer_output", False, "cpu")
    assert cfg.rollout.max_completion_length == 512 and cfg.model.gradient_checkpointing  # TRL's defaults
    assert run_config(max_steps=1, use_vllm=True).rollout.engine == "vllm"
    assert run_config(max_steps=1, grpo_overrides={"rollout.engine": "hf-static"}).rollout.engine == "hf-static"


def test_router_aux_loss_coef_maps_both_ways():
    """TRL's router_aux_loss_coef is loss.router_aux_loss_coef: None (the MoE config's own) by default, a value
    kept, and read back from a grpo config (the loss itself: tests/test_load_balancing.py)."""
    assert run_config(max_steps=1).loss.router_aux_loss_coef is None
    cfg = run_config(max_steps=1, router_aux_loss_coef=0.02)
    assert cfg.loss.router_aux_loss_coef == 0.02
    assert GRPOConfig.from_run_config(cfg).router_aux_loss_coef == 0.02
    assert GRPOConfig.from_run_config(cfg).to_run_config() == cfg


@pytest.mark.parametrize("field, value", [("push_to_hub", True), ("loss_type", "ppo"),
                                          ("save_strategy", "best"),
                                          ("generation_kwargs", {"do_sample": False})])
def test_a_trl_field_grpo_does_not_implement_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"GRPOConfig.{field}.*not supported"):
        GRPOConfig(**{field: value})


def test_names_trl_does_not_have_are_type_errors_and_inert_ones_are_kept():
    with pytest.raises(TypeError, match="unexpected argument 'warmup_ratio'"):  # gone in transformers 5, as there
        GRPOConfig(warmup_ratio=0.1)
    args = GRPOConfig(dataloader_num_workers=2, run_name="x", activation_checkpointing=False)
    assert args.dataloader_num_workers == 2 and args.run_name == "x" and args.gradient_checkpointing is False
    assert args.activation_checkpointing is False  # transformers >= 5.24's name, mirrored both ways
    assert GRPOConfig(gradient_checkpointing=False).activation_checkpointing is False
    assert args.push_to_hub is False  # TRL's default reads back


def test_every_trl_grpo_config_field_is_known():
    trl = pytest.importorskip("trl")
    names = {f.name for f in dataclasses.fields(GRPOConfig)} | set(UNSUPPORTED) | set(ACCEPTED_AS_IS)
    missing = [f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name not in names]
    assert not missing, f"TRL fields neither mapped, refused nor accepted: {missing}"


def test_a_bad_value_is_a_config_error_naming_grpoconfig():
    with pytest.raises(ConfigError, match=r"GRPOConfig: .*epsilon"):
        run_config(max_steps=1, epsilon=-1.0)


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_recipe_round_trips(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(Path("configs") / recipe)
    assert GRPOConfig.from_yaml(Path("configs") / recipe).to_run_config() == cfg


def test_to_yaml_writes_the_recipe_grpo_train_runs(tmp_path):
    args = GRPOConfig(max_steps=6, per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                      grpo_overrides={"data.train": "synthetic:seed=1,n=64"})
    text = args.to_yaml(tmp_path / "recipe.yaml")
    assert "prompts_per_step: 1" in text
    assert load_config(tmp_path / "recipe.yaml") == args.to_run_config()


def test_the_docs_table_names_every_refused_field():
    section = (REPO / "docs" / "guides" / "python-api.md").read_text()
    missing = [name for name in UNSUPPORTED if f"`{name}`" not in section]
    assert not missing, f"docs/guides/python-api.md does not name {missing}"
    # and lists none the API accepts (issue 42: max_tool_calling_iterations stayed there once it worked)
    table = section[section.index("| field | why |"):].split("\n\n")[0]
    listed = [row.split("`")[1] for row in table.splitlines()[2:]]
    assert set(listed) == set(UNSUPPORTED), f"refused in docs/guides/python-api.md but accepted: {sorted(set(listed) - set(UNSUPPORTED))}"
