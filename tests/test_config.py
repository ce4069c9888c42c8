"""grpo.config: YAML + overrides, checks that name the key, round trip through YAML."""

from __future__ import annotations

import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.config import ConfigError, RunConfig, dump_config, iter_config_keys, load_config, parse_override


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_are_valid_and_follow_trl_names():
    config = load_config()
    assert isinstance(config, RunConfig)
    keys = {k for k, *_ in iter_config_keys()}
    for leaf in ["rollout.num_generations", "rollout.max_completion_length", "rollout.temperature", "rollout.top_p",
                 "loss.beta", "loss.epsilon", "loss.epsilon_high", "loss.loss_type", "loss.scale_rewards",
                 "loss.num_iterations", "optim.learning_rate", "train.max_steps", "optim.warmup_ratio",
                 "optim.lr_scheduler_type", "optim.max_grad_norm", "optim.weight_decay", "train.seed",
                 "train.output_dir", "train.save_steps", "log.logging_steps", "model.gradient_checkpointing",
                 "model.bf16", "model.name_or_path", "model.ref_name_or_path", "model.lora_r", "data.train",
                 "data.eval", "train.prompts_per_step", "train.eval_steps", "rewards"]:
        assert leaf in keys, leaf
    assert all(help_text for _, _, _, help_text in iter_config_keys()), "every key is documented"


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, """
        model:
          name_or_path: /models/qwen
          lora_r: 16
        rollout:
          num_generations: 4
        optim:
          learning_rate: 1e-5   # PyYAML reads this as a string; it must still be a float
        rewards:
          - {name: answer_correct, weight: 1.0}
          - format_think_answer
    """)
    config = load_config(path, ["rollout.num_generations=8", "train.max_steps=7", "loss.epsilon_high=0.28",
                                "model.ref_name_or_path=null", "log.report_to=[]"])
    assert config.model.name_or_path == "/models/qwen" and config.model.lora_r == 16
    assert config.rollout.num_generations == 8  # the override wins over the file
    assert config.optim.learning_rate == 1e-5 and isinstance(config.optim.learning_rate, float)
    assert config.train.max_steps == 7 and config.loss.epsilon_high == 0.28
    assert config.log.report_to == []
    assert [(r.name, r.weight) for r in config.rewards] == [("answer_correct", 1.0), ("format_think_answer", 1.0)]
    rewards = load_config(None, ["rewards=[{name: answer_correct, weight: 2.0, params: {tag_style: think}}]"]).rewards
    assert rewards[0].weight == 2.0 and rewards[0].params == {"tag_style": "think"}


def test_sampling_controls_load_within_their_ranges():
    r = load_config(None, ["rollout.repetition_penalty=1.1", "rollout.min_new_tokens=4", "rollout.min_p=0.05"]).rollout
    assert (r.repetition_penalty, r.min_new_tokens, r.min_p) == (1.1, 4, 0.05)
    defaults = RunConfig().rollout  # off: today's sampling and log-probs
    assert (defaults.repetition_penalty, defaults.min_new_tokens, defaults.min_p) == (1.0, 0, 0.0)
    # the reference server is fine without the controls, or without a KL term (then it is not used)
    load_config(None, ["train.mode=decoupled", "decoupled.ref_server=true"])
    load_config(None, ["train.mode=decoupled", "decoupled.ref_server=true", "rollout.min_p=0.05", "loss.beta=0"])


def test_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["model.lora_r=8", "rollout.top_k=50", "data.eval=synthetic:seed=123,n=500"])
    path = tmp_path / "dumped.yaml"
    dump_config(config, path)
    assert load_config(path) == config


@pytest.mark.parametrize("override,expected", [
    ("train.max_step=3", r"unknown key train\.max_step; did you mean train\.max_steps\?"),
    ("modle.lora_r=1", r"unknown key modle; did you mean model\?"),
    ("train.max_steps=abc", r"train\.max_steps: expected int, got 'abc'"),
    ("model.bf16=1", r"model\.bf16: expected bool"),
    ("rollout.temperature=0", r"rollout\.temperature: 0\.0 is out of range: must be > 0"),
    ("optim.warmup_ratio=1.5", r"optim\.warmup_ratio: 1\.5 is out of range: must be <= 1"),
    ("loss.loss_type=ppo", r"loss\.loss_type: 'ppo' is not allowed; choose one of: grpo, bnpo, dr_grpo, dapo"),
    ("algorithm.advantage_estimator=ppo",
     r"algorithm\.advantage_estimator: 'ppo' is not allowed; choose one of: grpo, rloo, reinforce_pp, gae"),
    ("loss.importance_sampling_level=seq",
     r"loss\.importance_sampling_level: 'seq' is not allowed; choose one of: token, sequence"),
    ("loss.scale_rewards=std", r"loss\.scale_rewards: 'std' is not allowed; choose one of: null, group, batch, none"),
    ("rollout.num_generations=0", r"rollout\.num_generations: 0 is out of range: must be >= 1"),
    ("rollout.repetition_penalty=0", r"rollout\.repetition_penalty: 0\.0 is out of range: must be > 0"),
    ("rollout.min_new_tokens=-1", r"rollout\.min_new_tokens: -1 is out of range: must be >= 0"),
    ("rollout.min_p=1.5", r"rollout\.min_p: 1\.5 is out of range: must be <= 1"),
    ("rollout.min_p=-0.1", r"rollout\.min_p: -0\.1 is out of range: must be >= 0"),
    ("rewards=[{name: x, wieght: 1}]", r"unknown key rewards\[0\]\.wieght; did you mean rewards\[0\]\.weight\?"),
    ("train.max_steps", r"expected section\.key=value"),
    ("train.max_steps=[1", r"not valid YAML"),
])
def test_bad_overrides_name_the_override_and_key(override, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(None, [override])
    assert repr(override) in str(info.value) or "section.key=value" in str(info.value)


@pytest.mark.parametrize("overrides,key,why", [
    (["train.micro_batch_size=7"], "train.micro_batch_size", "does not divide the step's 64 completions"),
    # train.mini_batches: whole groups per update, equal micro-batches in each, every trainer rank's share, and no
    # partial rollouts (a varying number of groups per step)
    (["train.mini_batches=3"], "train.mini_batches", "does not divide train.prompts_per_step 8"),
    (["train.mini_batches=8"], "train.micro_batch_size", "does not divide a mini-batch's 8 completions"),
    (["train.mode=decoupled", "decoupled.trainer_ranks=2", "train.mini_batches=8", "train.micro_batch_size=8"],
     "train.mini_batches", "does not divide a trainer rank's 4 prompts"),
    (["train.mode=decoupled", "decoupled.partial_rollouts=true", "train.max_staleness=2", "train.mini_batches=2"],
     "train.mini_batches", "cannot divide yet"),
    (["model.ref_name_or_path=/models/teacher", "loss.beta=0"], "model.ref_name_or_path", "loss.beta is 0"),
    (["loss.epsilon_high=0.1"], "loss.epsilon_high", "only raises the upper bound"),
    (["optim.lora_learning_rate=1e-4"], "optim.lora_learning_rate", "model.lora_r is 0"),
    (["rewards=[]"], "rewards", "at least one reward"),
    (["train.early_stop_accuracy=0.5"], "train.early_stop_accuracy", "needs data.eval"),
    (["log.report_to=[mlflow]"], "log.report_to", "unknown tracker 'mlflow'"),
    (["algorithm.advantage_estimator=rloo", "loss.scale_rewards=group"], "loss.scale_rewards",
     "whose scaling is part of its definition"),
    (["algorithm.advantage_estimator=reinforce_pp", "loss.scale_rewards=none"], "loss.scale_rewards",
     "set loss.scale_rewards: null"),
    (["rollout.min_new_tokens=300"], "rollout.min_new_tokens", "no completion could ever end with EOS"),
    (["train.mode=decoupled", "decoupled.ref_server=true", "rollout.min_p=0.05"], "decoupled.ref_server",
     "its protocol carries only a temperature"),
    (["ptx.coef=0.5"], "ptx", "ptx.data is null"),
    (["decoupled.encrypt=true", "decoupled.address=inproc://rollouts"], "decoupled.encrypt",
     "inproc skips ZeroMQ's security handshake"),
    (["ptx.data=sft.jsonl", "ptx.coef=0"], "ptx.coef", "> 0"),
    (["decoupled.weight_sync=broadcast", "model.lora_r=8"], "decoupled.weight_sync",
     "a LoRA adapter travels through files"),
    (["decoupled.weight_sync=nccl"], "decoupled.weight_sync", "broadcast"),
    (["train.max_tokens_per_micro_batch=4096", "train.deepspeed=configs/ds_zero2.json"],
     "train.max_tokens_per_micro_batch", "a different number each step"),
])
def test_invalid_combinations_say_why(overrides, key, why):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert key in str(info.value) and why in str(info.value)


def test_file_errors_name_file_and_line(tmp_path):
    path = write(tmp_path, """
        model:
          lora_r: 8
        train:
          prompts_per_step: 4
          max_stepz: 10
    """)
    with pytest.raises(ConfigError, match=rf"{path}:6: unknown key train\.max_stepz; did you mean train\.max_steps\?"):
        load_config(path)
    bad_type = write(tmp_path, "rollout:\n  temperature: hot\n")
    with pytest.raises(ConfigError, match=rf"{bad_type}:2: rollout\.temperature: expected float"):
        load_config(bad_type)
    broken = write(tmp_path, "model:\n  name_or_path: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{broken}:\d+: invalid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    assert load_config(write(tmp_path, "")) == load_config(None)  # an empty file means all defaults (resolved)


def test_parse_override_values_are_yaml():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=null") == ("a.b", None)
    assert parse_override("a.b=x=y") == ("a.b", "x=y")  # only the first '=' splits
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_fuzz_override_never_crashes_with_anything_but_config_error(text):
    try:
        load_config(None, [text])
    except ConfigError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "train", "loss", "bogus"]),
                       st.dictionaries(st.text(max_size=12), st.one_of(st.none(), st.integers(), st.floats(),
                                                                       st.text(max_size=8), st.booleans()),
                                       max_size=3), max_size=3))
def test_fuzz_config_tree_never_crashes_with_anything_but_config_error(tmp_path_factory, tree):
    import yaml

    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        load_config(path)
    except ConfigError:
        pass


def test_every_shipped_recipe_loads():
    from pathlib import Path

    recipes = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(recipes) >= 4
    for recipe in recipes:
        text = recipe.read_text()
        assert text.startswith("#") and "grpo train" in text.split("\n\n")[0], f"{recipe.name}: launch command header"
        load_config(recipe)
