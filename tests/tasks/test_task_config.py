"""The task in the config: a recipe without ``rewards`` gets its task's default rewards (through the YAML loader,
the overrides and the Python API's mapping), one that lists rewards keeps them, and a ``data.task`` that does
not resolve is a ConfigError naming the key when the config loads."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
import types

import pytest

from grpo.config import ConfigError, RewardConfig, config_from_dict, dump_config, load_config
from grpo.tasks import Task

NUMERIC = [RewardConfig("answer_correct", 1.0), RewardConfig("format_think_answer", 1.0)]


def _names(cfg) -> list[tuple[str, float]]:
    return [(r.name, r.weight) for r in cfg.rewards]


def test_a_recipe_without_rewards_gets_its_tasks(tmp_path):
    assert _names(load_config(None, ["data.train=kk:seed=1,n=50"])) == [("kk_logic", 1.0)]
    assert load_config(None, ["data.train=synthetic:seed=1,n=8"]).rewards == NUMERIC
    assert load_config(None, ["data.train=openai/gsm8k"]).rewards == NUMERIC
    # data.task wins over the data source's task
    assert _names(load_config(None, ["data.train=openai/gsm8k", "data.task=arithmetic"])) == _names(
        load_config(None, ["data.train=synthetic:seed=1,n=8"]))
    assert _names(load_config(None, ["data.train=reasoning_gym:chain_sum", "data.task=reasoning_gym"])) == [
        ("reasoning_gym", 1.0), ("format_think_answer", 0.1)]
    # a verifiers taskset: no reward of the task's own, the environment's rubric scores the episodes
    assert load_config(None, ["data.train=verifiers:some_env"]).rewards == []
    recipe = tmp_path / "kk.yaml"
    recipe.write_text("data:\n  train: kk:seed=1,n=50\n")
    cfg = load_config(recipe)
    assert _names(cfg) == [("kk_logic", 1.0)]
    # rewards: null is "not given": an override hands a recipe's own rewards back to the task
    recipe.write_text("data:\n  train: kk:seed=1,n=50\nrewards: [{name: xmlcount}]\n")
    assert _names(load_config(recipe)) == [("xmlcount", 1.0)]
    assert load_config(recipe, ["rewards=null"]) == cfg
    assert config_from_dict({"data": {"train": "kk:seed=1,n=50"}, "rewards": None}, "test") == cfg
    # the run folder's config.yaml records what was chosen, and reads back as the same config
    saved = tmp_path / "config.yaml"
    dump_config(cfg, saved)
    assert "kk_logic" in saved.read_text() and load_config(saved) == cfg


def test_a_recipe_that_lists_rewards_keeps_them_exactly(tmp_path):
    listed = "[{name: format_think_answer, weight: 0.5}, {name: xmlcount}]"
    cfg = load_config(None, ["data.train=kk:seed=1,n=50", f"rewards={listed}"])
    assert _names(cfg) == [("format_think_answer", 0.5), ("xmlcount", 1.0)]
    recipe = tmp_path / "kk.yaml"
    recipe.write_text(textwrap.dedent("""\
        data: {train: 'kk:seed=1,n=50'}
        rewards:
          - {name: format_think_answer, weight: 2.0}
    """))
    assert _names(load_config(recipe)) == [("format_think_answer", 2.0)]
    # an empty list is kept too, and refused for what it is
    with pytest.raises(ConfigError, match=r"rewards is empty"):
        load_config(None, ["data.train=kk:seed=1,n=50", "rewards=[]"])


def test_the_python_api_mapping_gets_the_tasks_rewards():
    from grpo.api import GRPOConfig

    assert _names(config_from_dict({"data": {"train": "kk:seed=1,n=50"}}, "test")) == [("kk_logic", 1.0)]
    args = GRPOConfig(max_steps=2, per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                      grpo_overrides={"data.train": "kk:seed=1,n=50"})
    assert _names(args.to_run_config()) == [("kk_logic", 1.0)]
    # and a K&K recipe read back as arguments gives the same config (the rewards travel in grpo_overrides
    # only where they differ from the task's)
    for overrides in (["data.train=kk:seed=1,n=50"], ["data.train=kk:seed=1,n=50", "rewards=[xmlcount]"]):
        cfg = load_config(None, overrides)
        assert GRPOConfig.from_run_config(cfg).to_run_config() == cfg


def _user_module(monkeypatch) -> types.ModuleType:
    module = types.ModuleType("tasks_for_config_test")
    module.echo = Task(name="echo", load=lambda source, split, limit: [], system_prompt=lambda style: "say it",
                       score=lambda text, gold, style: {"prediction": text, "correct": text == gold,
                                                        "formatted": True},
                       rewards=(("answer_correct", 2.0), ("xmlcount", 0.5)))
    module.silent = Task(name="silent", load=lambda source, split, limit: [], system_prompt=lambda style: "",
                         score=lambda text, gold, style: {}, rewards=())
    module.three = 3

    def broken():
        raise TypeError("the factory refuses")

    module.broken = broken
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_users_task_gives_its_rewards(monkeypatch):
    _user_module(monkeypatch)
    cfg = load_config(None, ["data.task=tasks_for_config_test:echo", "data.train=mine:anything"])
    assert _names(cfg) == [("answer_correct", 2.0), ("xmlcount", 0.5)]
    # a task without default rewards needs the recipe's
    with pytest.raises(ConfigError, match=r"rewards is empty .*task's default rewards are none"):
        load_config(None, ["data.task=tasks_for_config_test:silent"])
    assert _names(load_config(None, ["data.task=tasks_for_config_test:silent", "rewards=[xmlcount]"])) == [
        ("xmlcount", 1.0)]


@pytest.mark.parametrize("task, why", [
    ("nope", r"unknown task 'nope'; built in: \['arithmetic', 'gsm8k', 'kk', 'reasoning_gym', 'verifiers'\]"),
    ("no_such_module_xyz:task", r"module 'no_such_module_xyz' does not import: ModuleNotFoundError"),
    ("tasks_for_config_test:missing", r"has no 'missing'"),
    ("tasks_for_config_test:three", r"is a int, not a grpo.tasks.Task"),
    ("tasks_for_config_test:broken", r"the factory refuses"),
    (":task", r"module '' does not import"),
])
def test_a_bad_data_task_is_a_config_error_naming_the_key(task, why, monkeypatch, tmp_path):
    _user_module(monkeypatch)
    with pytest.raises(ConfigError, match=rf"^override 'data.task={task}': data.task is '{task}': .*{why}"):
        load_config(None, [f"data.task={task}"])
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"train:\n  max_steps: 2\ndata:\n  task: '{task}'\n")
    with pytest.raises(ConfigError, match=rf"^{recipe}:4: data.task is "):
        load_config(recipe)
    with pytest.raises(ConfigError, match=r"^GRPOConfig: data.task is "):
        config_from_dict({"data": {"task": task}}, "GRPOConfig")


def test_a_task_module_with_a_syntax_error_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "broken_task_module.py").write_text("def task(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"data.task is .*does not import: SyntaxError"):
        load_config(None, ["data.task=broken_task_module:task"])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("source, logged", [
    ("kk:seed=1,n=64", ["reward/kk_logic", "kk_logic/per_person_accuracy"]),
    ("reasoning_gym:word_sorting,size=64,seed=3", ["reward/reasoning_gym", "reward/format_think_answer",
                                                   "reasoning_gym/word_sorting"]),
])
def test_grpo_train_without_a_recipe_trains_with_the_tasks_rewards(source, logged, tmp_path):
    """The command line end to end, as a new user types it: no recipe (grpo's default, the arithmetic demo's) and
    a data source of another task: the run is scored by that task's rewards, logged under their names, and its
    config.yaml says they came from the task. Then `grpo eval` of the run on the demo's arithmetic is refused, as
    the task's scorer cannot read it (exit 2)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("reasoning_gym")
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    # the command line, made short (K&K prompts of up to 8 people are longer than the demo's 512 tokens)
    overrides = [f"data.train={source}", "train.max_steps=1", "train.prompts_per_step=2", "train.micro_batch_size=16",
                 "rollout.max_completion_length=16", "data.max_prompt_length=1024", f"train.output_dir={out}",
                 "log.report_to=[]", "log.progress_bar=false", "log.plots=false", "train.save_final=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "grpo", "train", *overrides], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no recipe given: configs/demo-cpu.yaml" in done.stderr
    cfg = load_config(out / "config.yaml")
    assert cfg.rewards == load_config(None, [f"data.train={source}"]).rewards and cfg.data.eval is None
    assert "# from the task: rewards (" in (out / "config.yaml").read_text()
    (step,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert all(key in step for key in logged) and "reward/answer_correct" not in step
    evaluated = subprocess.run([sys.executable, "-m", "grpo", "eval", str(out), "--data", "synthetic:seed=1,n=4"],
                               cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 2 and "pass --task for the data's task" in evaluated.stderr


@pytest.mark.parametrize("recipe", ["kk-qwen2.5-3b-grpo.yaml", "kk-qwen2.5-3b-ppo.yaml"])
def test_the_kk_gpu_recipes_train_kk_with_kk_logic(recipe):
    """The K&K GPU recipes (a 3B model: validated here, not run) read the public K&K files with the kk task's
    reward; with the generated source their headers give, the task loads puzzles of the sizes they train on."""
    from pathlib import Path

    from grpo.tasks import run_task
    from grpo.data.knights_knaves.text import solution_roles

    path = Path(__file__).resolve().parents[2] / "configs" / recipe
    cfg = load_config(path)
    assert cfg.data.task == "kk" and cfg.data.train.startswith("kk:path=") and cfg.data.eval.startswith("kk:path=")
    assert _names(cfg) == [("kk_logic", 1.0)] and cfg.model.name_or_path == "Qwen/Qwen2.5-3B-Instruct"
    header = path.read_text().split("model:\n", 1)[0]
    generated = "data.train=kk:seed=1,n=5000,people=3-7 data.eval=kk:seed=2,n=100,people=5"
    assert generated in header and "K-and-K/knights-and-knaves" in header
    cfg = load_config(path, [*generated.split(), "data.train_limit=20"])
    train = run_task(cfg).load(cfg.data.train, cfg.data.split, cfg.data.train_limit)
    sizes = {len(solution_roles(example.answer)) for example in train}
    assert len(train) == 20 and sizes <= {3, 4, 5, 6, 7} and len(sizes) > 1


@pytest.mark.parametrize("decoupled_sampler", [False, True])
def test_every_role_renders_and_loads_through_the_task(decoupled_sampler, monkeypatch):
    """The rollout settings of the colocated loop and the decoupled sampler (``experience_settings``) carry the
    task's system prompt, and ``load_data`` (both roles' data) reads through the task's own loader."""
    from grpo.tasks import resolve_task, run_task
    from grpo.training.inputs import load_data
    from grpo.training.settings import experience_settings

    def settings(*overrides):
        cfg = load_config(None, ["data.train=kk:seed=1,n=4,people=2", *overrides])
        return experience_settings(cfg, None, task=run_task(cfg), decoupled_sampler=decoupled_sampler,
                                   engine_holds_weights=False)

    assert settings().system_prompt == resolve_task("kk").system_prompt("think")
    assert settings("data.tag_style=reasoning").system_prompt == resolve_task("kk").system_prompt("reasoning")
    assert settings("data.system_prompt=Solve it.").system_prompt == "Solve it."
    assert settings("data.add_system_prompt=false").system_prompt is None

    module = _user_module(monkeypatch)
    calls = []
    module.echo = dataclasses.replace(module.echo, load=lambda source, split, limit: calls.append(
        (source, split, limit)) or [])
    cfg = load_config(None, ["data.task=tasks_for_config_test:echo", "data.train=mine:train", "data.eval=mine:eval",
                             "data.train_limit=3"])
    assert load_data(cfg, run_task(cfg)) == ([], {"": []})  # one unnamed held-out set (data.eval a plain source)
    assert calls == [("mine:train", "train", 3), ("mine:eval", "test", None)]
