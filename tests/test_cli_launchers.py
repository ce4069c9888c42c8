"""The command line: under launchers and on other hosts (DeepSpeed's --local_rank, ref-server --host), and overrides after options."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo.cli import build_parser, main


@pytest.mark.parametrize("flag", ["--local_rank=3", "--local-rank=3"])
def test_deepspeeds_local_rank_argument_is_accepted(flag, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "")  # recorded as it was, so the LOCAL_RANK main() sets is undone after
    monkeypatch.delenv("LOCAL_RANK")  # (a leaked LOCAL_RANK made later in-process trainers think they were launched)
    assert build_parser().parse_args(["train", flag, "x.yaml"]).local_rank == 3
    assert build_parser().parse_args(["trainer", "x.yaml", flag]).local_rank == 3
    # DeepSpeed's launcher runs `python -u -m grpo --local_rank=N train ...`: before the subcommand.
    assert build_parser().parse_args([flag, "train", "x.yaml", "a.b=1"]).local_rank == 3
    assert build_parser().parse_args([flag, "sampler", "x.yaml"]).local_rank == 3
    assert not hasattr(build_parser().parse_args(["train", "x.yaml"]), "local_rank")
    assert main(["train", flag, "no-such-recipe.yaml"]) == 2  # a clear config error, not argparse's exit 2
    assert main([flag, "train", "no-such-recipe.yaml"]) == 2
    assert os.environ["LOCAL_RANK"] == "3"


def test_ref_server_host_reaches_the_server(monkeypatch):
    import grpo.commands.handlers as ref_server  # the command calls the name it imported

    calls = []
    monkeypatch.setattr(ref_server, "run_ref_server", lambda path, **kwargs: calls.append(kwargs))
    assert main(["ref-server", "--host", "10.0.0.2", "decoupled.token_env=GRPO_TOKEN"]) == 0
    assert main(["ref-server", "decoupled.ref_server_host=0.0.0.0"]) == 0
    assert [c["host"] for c in calls] == ["10.0.0.2", "0.0.0.0"]
    assert main(["ref-server"]) == 0 and calls[-1]["host"] == "127.0.0.1"  # the default stays loopback


def test_overrides_may_follow_options():
    from grpo.cli import parse_arguments

    args = parse_arguments(["train", "x.yaml", "a.b=1", "--overwrite", "log.progress_bar=false", "c.d=2"])
    assert args.overwrite and args.config == "x.yaml"
    assert args.overrides == ["a.b=1", "log.progress_bar=false", "c.d=2"]


def test_unknown_arguments_still_fail():
    from grpo.cli import parse_arguments

    with pytest.raises(SystemExit):
        parse_arguments(["train", "x.yaml", "--overwrite", "--no-such-flag"])
    with pytest.raises(SystemExit):  # plot takes no overrides
        parse_arguments(["plot", "runs/x", "a.b=1"])


def test_every_command_names_a_handler_that_exists():
    import grpo.commands.handlers as handlers
    import grpo.commands.launch as launch  # `grpo train`'s (grpo.cli imports it for that command alone)

    sub = next(a for a in build_parser()._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name, parser in sub.choices.items():
        handler = parser.get_default("handler")
        module = launch if handler == "train_command" else handlers
        assert callable(getattr(module, handler, None)), f"grpo {name}: no handler {handler!r} in {module.__name__}"
    assert not hasattr(handlers, "train_command")


def test_the_decoupled_launcher_loads_no_transformers_or_peft():
    # the launcher checks the recipe and starts the roles, which load them: seconds before the roles start
    code = ("import sys\nimport grpo.commands.launch, grpo.decoupled.launcher\n"
            "from grpo.config import load_config\n"
            "load_config(None, ['train.mode=decoupled'])\n"
            "print(sorted(m for m in ('transformers', 'peft', 'grpo.rollout', 'grpo.decoupled.transport') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_and_a_mistyped_command_load_no_torch():
    # `grpo --help` used to import every command (torch, transformers: seconds); the handlers load when one runs.
    code = ("import sys\nfrom grpo.cli import main\n"
            "for argv in (['--help'], ['trian']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'grpo.commands.handlers') if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr
