"""One resolution of a run (``grpo.config.resolve``): every entry point that reads a run (``grpo config``,
``grpo train`` colocated and through the decoupled launcher to its roles, ``grpo trainer`` / ``grpo sampler``,
``grpo memory``, the Python API) resolves the same command line to the same config, whose rewards are its task's
where the user set none; a reward or held-out set that cannot read the data's gold is refused before anything is
written.

The entry points run in process with the step after resolution replaced by a catch (no model is loaded), from the
checkout's root, where ``configs/demo-cpu.yaml`` is the default recipe."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import pytest
import yaml

from grpo import cli
from grpo.config import ConfigError, RunConfig, config_from_dict, resolve_run
from grpo.tasks import resolve_task

REPO = Path(__file__).resolve().parents[2]


class Resolved(Exception):
    """Raised by a stand-in for the step after resolution, carrying the config it was given."""

    def __init__(self, config: RunConfig):
        super().__init__("resolved")
        self.config = config


def _catch(config, *args, **kwargs):
    raise Resolved(config)


def _run(argv: list[str]) -> RunConfig | str | None:
    """``grpo ARGV`` in process: the config its step was given; else (exit 2) the error it printed; None when it
    returned 0 without reaching a caught step (the stand-in launcher)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except Resolved as done:
            return done.config
    assert status in (0, 2), f"grpo {' '.join(argv)} exited {status}: {err.getvalue()}"
    return err.getvalue().strip() if status == 2 else None


def _error(err: ConfigError) -> str:
    """What the command line prints for ``err`` (``grpo.errors.exit_status``)."""
    return f"grpo: configuration error: {err}"


def _resolved(recipe: str | None, overrides: list[str]) -> RunConfig | str:
    try:
        return resolve_run(recipe, overrides).config
    except ConfigError as err:
        return _error(err)


@pytest.fixture
def entry_points(monkeypatch):
    """``{name: argv -> config or error}`` for every command-line entry point, their steps replaced by the catch."""
    import grpo.commands.handlers as handlers
    import grpo.commands.launch as launch
    import grpo.commands.memory.report as memory
    import grpo.training.colocated as colocated

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RANK", raising=False)
    for module, name in ((colocated, "train"), (handlers, "run_trainer_role"), (handlers, "run_sampler_role"),
                         (memory, "estimate_memory")):
        monkeypatch.setattr(module, name, _catch)
    launches = []
    monkeypatch.setattr(launch, "run_decoupled", lambda cfg, recipe, overrides: launches.append(
        (cfg, recipe, overrides)) or 0)

    def config_command(argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            error = _run(["config", *argv])
        # what it prints reads back as the config it resolved (a recipe listing every key)
        return error if isinstance(error, str) else config_from_dict(yaml.safe_load(out.getvalue()), "grpo config")

    def launched_role(role):
        def run(argv):
            launches.clear()
            first = _run(["train", *argv, "train.mode=decoupled"])
            if isinstance(first, str):
                return first
            (cfg, recipe, overrides), = launches
            from grpo.decoupled.launcher import role_command

            role_cfg = _run(role_command(role, recipe, overrides)[3:])  # [python, -m, grpo, role, ...]
            assert role_cfg == cfg, f"the launched {role} resolved another config than the launcher"
            return role_cfg
        return run

    return {"config": config_command, "train": lambda argv: _run(["train", *argv]),
            "memory": lambda argv: _run(["memory", *argv]),
            "trainer": lambda argv: _run(["trainer", *argv]), "sampler": lambda argv: _run(["sampler", *argv]),
            "launched trainer": launched_role("trainer"), "launched sampler": launched_role("sampler")}


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> dict[str, str]:
    """A user's GSM8K-style JSONL and Parquet files (question, answer ending '#### N')."""
    import pandas as pd

    folder = tmp_path_factory.mktemp("user-data")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(4)]
    (folder / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_parquet(folder / "mine.parquet")
    return {"jsonl": str(folder / "mine.jsonl"), "parquet": str(folder / "mine.parquet")}


SOURCES = {  # source kind -> data.train (a file kind: a key of data_files)
    "gsm8k jsonl": "jsonl", "user parquet": "parquet", "synthetic": "synthetic:seed=1,n=8",
    "kk": "kk:seed=1,n=8", "reasoning_gym": "reasoning_gym:word_sorting,size=64,seed=3",
    "verifiers": "verifiers:vf_echo_env", "prompts file": "prompts:path={jsonl},answer_format=gsm8k",
    "tool problems": "arithmetic-tools:seed=1,n=8",
}


def _source(kind: str, data_files: dict[str, str]) -> str:
    value = SOURCES[kind]
    return data_files[value] if value in data_files else value.format(**data_files)


def _task_rewards(source: str) -> list[tuple[str, float]]:
    return [(name, float(weight)) for name, weight in resolve_task(None, source).rewards]


def _names(cfg: RunConfig) -> list[tuple[str, float]]:
    return [(r.name, r.weight) for r in cfg.rewards]


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_entry_point_resolves_a_source_to_one_config_with_the_tasks_rewards(kind, entry_points, data_files):
    source = _source(kind, data_files)
    argv = [f"data.train={source}"]
    reference = resolve_run(None, argv).config
    for name, entry in entry_points.items():
        launched = name.startswith("launched")  # the launcher adds train.mode=decoupled for its roles
        want = resolve_run(None, [*argv, "train.mode=decoupled"]).config if launched else reference
        assert entry(argv) == want, f"{name} resolved data.train={source} otherwise"
    # the default recipe's rewards are the arithmetic demo's: kept for its own task, the task's for any other
    demo = resolve_run(None, []).config
    expected = _names(demo) if resolve_task(None, source).name == "arithmetic" else _task_rewards(source)
    assert _names(reference) == expected
    # a recipe of the user's that lists no rewards: the task's, for every source
    assert _names(resolve_run(REPO / "tests" / "tasks" / "no_rewards.yaml", argv).config) == _task_rewards(source)


def test_the_python_api_resolves_as_the_command_line(data_files):
    from grpo.api import GRPOConfig

    for kind in sorted(SOURCES):
        source = _source(kind, data_files)
        cfg = resolve_run(None, [f"data.train={source}"]).config
        args = GRPOConfig.from_run_config(cfg)
        assert args.to_run_config() == cfg, kind
        fresh = GRPOConfig(max_steps=2, per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                           grpo_overrides={"data.train": source})
        assert _names(fresh.to_run_config()) == _task_rewards(source), kind


def test_a_dataset_object_without_reward_funcs_trains_with_its_tasks_rewards_and_prompt(tiny_model_dir, capsys):
    from datasets import Dataset

    from grpo.api import GRPOConfig, GRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "answer": str(i + 1)} for i in range(8)]
    args = GRPOConfig(output_dir="unused", max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      use_cpu=True, report_to="none")
    trainer = GRPOTrainer(str(tiny_model_dir), args=args, train_dataset=Dataset.from_list(rows))
    assert _names(trainer.config) == _task_rewards("openai/gsm8k")  # gsm8k's: a number in <answer>
    assert trainer.config.data.add_system_prompt  # the format those rewards score is asked for
    assert "reward_funcs is None: training with answer_correct 1, format_think_answer 1" in capsys.readouterr().out
    # a dataset without the gold column those rewards read is refused at once
    no_gold = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    with pytest.raises(ValueError, match=r"read the gold answer from the column 'answer'.*pass reward_funcs"):
        GRPOTrainer(str(tiny_model_dir), args=args, train_dataset=no_gold)


def test_the_config_yaml_says_what_came_from_the_task():
    text = cli_config_text(["data.train=kk:seed=1,n=8"])
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[1:] == ["# task: kk (chosen by data.train kk:seed=1,n=8)",
                          "# from the task: rewards (kk_logic 1); the system prompt (the task's, in data.tag_style "
                          "think)"]
    mine = cli_config_text(["data.train=kk:seed=1,n=8", "rewards=[xmlcount]", "data.system_prompt=Solve.",
                            "data.eval=kk:seed=2,n=4"])
    assert "# from the task: evaluation's scoring of data.eval (Knights-and-Knaves solutions" in mine


def cli_config_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["config", *argv]) == 0
    return out.getvalue()


def test_the_default_recipe_gives_way_to_the_task_of_the_overrides(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    run = resolve_run(None, ["data.train=kk:seed=1,n=8"])
    assert run.default_recipe and run.set_aside == ("rewards", "data.eval")
    assert run.config.data.eval is None and _names(run.config) == [("kk_logic", 1.0)]
    # what the user sets on the command line stays
    kept = resolve_run(None, ["data.train=kk:seed=1,n=8", "data.eval=kk:seed=2,n=4", "rewards=[format_think_answer]"])
    assert kept.set_aside == () and kept.config.data.eval == "kk:seed=2,n=4"
    assert _names(kept.config) == [("format_think_answer", 1.0)]
    # the default recipe's own task keeps every key; and `grpo config` says what it set aside
    assert resolve_run(None, ["data.train=synthetic:seed=5,n=8"]).set_aside == ()
    cli_config_text(["data.train=kk:seed=1,n=8"])
    assert cli.main(["config", "data.train=kk:seed=1,n=8"]) == 0
    err = capsys.readouterr().err
    assert "no recipe given: configs/demo-cpu.yaml (grpo's default recipe, task arithmetic)" in err
    assert "rewards kk_logic 1 (the task's), no held-out set (set data.eval)" in err


@pytest.mark.parametrize("source, fix", [("reasoning_gym:word_sorting,size=64,seed=3", "use reasoning_gym instead"),
                                         ("kk:seed=1,n=64", "use kk_logic instead")])
def test_a_reward_that_cannot_read_the_gold_exits_2_before_anything_is_written(source, fix, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    assert cli.main(["train", f"data.train={source}", "rewards=[{name: answer_correct}]",
                     f"train.output_dir={out}"]) == 2
    message = capsys.readouterr().err
    assert "rewards[0].name is answer_correct, which reads a number or math expression" in message
    assert fix in message and f"({source}) gives" in message
    assert not out.exists()
    with pytest.raises(ValueError, match=r"rewards\[0\]\.name is answer_correct"):  # a ValueError from Python
        config_from_dict({"data": {"train": source}, "rewards": [{"name": "answer_correct"}]}, "GRPOConfig")


def test_a_held_out_set_the_tasks_scorer_cannot_read_is_refused():
    with pytest.raises(ConfigError, match=r"data\.eval\.demo is synthetic:seed=1,n=3, which gives a number .* but the "
                                          r"task kk scores Knights-and-Knaves solutions"):
        resolve_run(None, ["data.train=kk:seed=1,n=8", "data.eval={demo: 'synthetic:seed=1,n=3'}"])
    with pytest.raises(ConfigError, match=r"data\.task is kk, which asks for .* data\.task=gsm8k or "
                                          r"data\.task=arithmetic, or data\.task=null"):
        resolve_run(None, ["data.train=synthetic:seed=1,n=8", "data.task=kk", "rewards=[format_think_answer]"])
    with pytest.raises(ConfigError, match=r"data\.eval is verifiers:vf_echo_env, which has no gold answer"):
        resolve_run(None, ["data.train=verifiers:vf_echo_env", "data.eval=verifiers:vf_echo_env"])


def test_the_eval_command_checks_its_sets_and_rewards_against_the_task():
    from grpo.commands.eval_command import check_eval_gold

    kk_run = resolve_run(None, ["data.train=kk:seed=1,n=8"]).config
    with pytest.raises(ConfigError, match=r"^--data is synthetic:.* task kk scores .*pass --task"):
        check_eval_gold(resolve_task("kk"), {"": "synthetic:seed=1,n=4"}, kk_run, None)
    with pytest.raises(ConfigError, match=r"^--rewards\[0\]\.name is kk_logic.*pass --rewards"):
        check_eval_gold(resolve_task("arithmetic"), {"": "synthetic:seed=1,n=4"}, kk_run, None)
    check_eval_gold(resolve_task("arithmetic"), {"": "synthetic:seed=1,n=4"}, kk_run, [])  # --rewards alone: none
    check_eval_gold(resolve_task("kk"), {"a": "kk:seed=2,n=4"}, kk_run, None)


# ---------------------------------------------------------------- random command lines

RECIPES = [None, "configs/smoke-cpu.yaml", "configs/kk-demo-cpu.yaml", "configs/rg-demo-cpu.yaml",
           "configs/tools-demo-cpu.yaml", "tests/tasks/no_rewards.yaml"]
CHOICES = {
    "data.train": ["synthetic:seed=3,n=8", "kk:seed=1,n=8", "reasoning_gym:chain_sum,size=8,seed=1", "openai/gsm8k",
                   "verifiers:vf_echo_env"],
    "data.eval": ["null", "synthetic:seed=4,n=4", "kk:seed=2,n=4", "{a: 'kk:seed=2,n=4'}"],
    "rewards": ["null", "[kk_logic]", "[answer_correct]", "[format_think_answer, xmlcount]", "[reasoning_gym]"],
    "data.task": ["null", "kk", "arithmetic", "reasoning_gym"],
    "data.tag_style": ["reasoning"],
    "train.max_steps": ["3"],
}


def _random_command_line(rng: random.Random) -> list[str]:
    recipe = rng.choice(RECIPES)
    keys = rng.sample(sorted(CHOICES), rng.randint(0, 4))
    return [*([recipe] if recipe else []), *(f"{key}={rng.choice(CHOICES[key])}" for key in keys)]


def test_no_random_command_line_resolves_differently_at_any_entry_point(entry_points):
    """A property over random recipe/override sets: every entry point gives what `grpo config` gives (the same
    config, or the same error), and that is ``resolve_run``'s."""
    rng = random.Random(57)
    outcomes = {"config": 0, "error": 0}
    for _ in range(24):
        argv = _random_command_line(rng)
        recipe = argv[0] if argv and "=" not in argv[0] else None
        overrides = argv[1:] if recipe else argv
        expected = _resolved(recipe, overrides)
        outcomes["error" if isinstance(expected, str) else "config"] += 1
        for name, entry in entry_points.items():
            launched = name.startswith("launched")
            want = _resolved(recipe, [*overrides, "train.mode=decoupled"]) if launched else expected
            assert entry(argv) == want, f"{name} resolved {argv} otherwise"
    assert min(outcomes.values()) >= 4, outcomes  # both kinds of outcome were drawn
