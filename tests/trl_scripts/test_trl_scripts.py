"""TRL 1.16 scripts (scripts/, each written from TRL's documentation) run under TRL and under grpo with only
the import line changed: the same global_step, the same callback event sequence, every key TRL logs present
in grpo's entry for the same step, the same checkpoints and the same resume behaviour.

Each script takes ``MODEL OUT`` and writes ``OUT/report.json`` (scripts/report_callback.py). The two sides run
as two processes at once, each a fresh interpreter as a user's script is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openenv_server import EchoServer, echo_server  # noqa: F401 (a fixture)

pytest.importorskip("trl")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TRL_IMPORT, GRPO_IMPORT = "from trl import GRPOConfig, GRPOTrainer\n", "from grpo import GRPOConfig, GRPOTrainer\n"
MODELS = {  # script -> shipped tiny model it trains
    "chat_lora_iterations": "tiny-math", "text_prompts_accumulation": "tiny-math",
    "evaluate_during_and_after": "tiny-math", "resume_named_checkpoint": "tiny-math",
    "evaluate_named_sets": "tiny-math", "resume_other_folder": "tiny-math",
    "rollout_func_generate": "tiny-math", "tools_with_system_prompt": "tiny-tools",
    "environment_factory": "tiny-tools", "openenv_echo": "tiny-tools", "openenv_echo_rollout_func": "tiny-math",
    "epoch_strategies": "tiny-math", "no_checkpoints_no_logs": "tiny-math",
    "gspo_steps_per_generation": "tiny-math", "cispo_entropy_masks": "tiny-math", "sapo_two_rewards": "tiny-math",
}
ECHO_SERVER = {"openenv_echo", "openenv_echo_rollout_func"}  # TRL's OpenEnv guide: a local echo server at ECHO_ENV_URL
# A user runs the script from a plain shell: no launcher's variables (accelerate reads LOCAL_RANK as "launched").
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SAME = ("global_step", "events", "checkpoints", "missing_checkpoint_error", "environments_created", "rollout_calls",
        "restored_steps", "best_recorded", "env_steps", "echoed_as_sent")


def grpo_source(source: str) -> str:
    """The script with its one TRL import line replaced, as a user switches."""
    assert source.count(TRL_IMPORT) == 1, "each script imports GRPOConfig, GRPOTrainer from trl on one line"
    return source.replace(TRL_IMPORT, GRPO_IMPORT)


def run_both(name: str, tmp: Path, echo: EchoServer | None = None) -> dict[str, dict]:
    source = (SCRIPTS / f"{name}.py").read_text()
    paths = [str(SCRIPTS), str(REPO / "src"), *([str(echo.package_root)] if echo else []),
             os.environ.get("PYTHONPATH", "")]
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}, "PYTHONPATH": os.pathsep.join(paths),
           "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1", **({"ECHO_ENV_URL": echo.url} if echo else {})}
    processes = {}
    for side, text in (("trl", source), ("grpo", grpo_source(source))):
        script = tmp / side / f"{name}.py"
        script.parent.mkdir(parents=True)
        script.write_text(text)
        log = open(tmp / side / "log.txt", "w")
        processes[side] = (subprocess.Popen([sys.executable, str(script), str(REPO / "assets" / MODELS[name]),
                                             str(tmp / side / "out")], cwd=tmp / side, env=env, stdout=log,
                                            stderr=subprocess.STDOUT), log)
    reports = {}
    for side, (process, log) in processes.items():
        process.wait(timeout=900)
        log.close()
        text = (tmp / side / "log.txt").read_text()
        assert process.returncode == 0, f"{name} under {side} failed:\n{text[-4000:]}"
        reports[side] = json.loads((tmp / side / "out" / "report.json").read_text())
    return reports


# TRL's evaluation runs its loss on sampled groups with the current weights as the old policy: the ratio is 1, so
# nothing is clipped on either side (grpo.training.eval_loss)
EVAL_CLIP_RATIOS = ("eval_clip_ratio/low_mean", "eval_clip_ratio/low_min", "eval_clip_ratio/high_mean",
                    "eval_clip_ratio/high_max", "eval_clip_ratio/region_mean")


# Log values that follow from the arguments alone (the adaptive entropy coefficient, with an entropy far below its
# target, steps up by entropy_coef_delta after every update whatever was sampled)
SAME_VALUE = ("entropy_coef",)


def missing_keys(trl_entry: dict, grpo_entry: dict) -> list[str]:
    return sorted(set(trl_entry) - set(grpo_entry))


def check_eval_loss(trl_entry: dict, grpo_entry: dict) -> None:
    """An evaluation's loss-pass values as TRL's: a finite loss and entropy per set, no clipping."""
    losses = [k for k in trl_entry if k.startswith("eval_") and k.endswith("_loss")]
    for key in losses + (["eval_entropy"] if losses else []):
        assert isinstance(grpo_entry[key], float) and grpo_entry[key] == grpo_entry[key], (key, grpo_entry[key])
    for key in EVAL_CLIP_RATIOS:
        if key in trl_entry:
            assert grpo_entry[key] == trl_entry[key] == 0.0, (key, grpo_entry[key], trl_entry[key])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_script_behaves_as_under_trl(name, tmp_path, request):
    reports = run_both(name, tmp_path, request.getfixturevalue("echo_server") if name in ECHO_SERVER else None)
    trl, grpo = reports["trl"], reports["grpo"]
    for key in SAME:
        assert grpo.get(key) == trl.get(key), f"{key}: grpo {grpo.get(key)} != TRL {trl.get(key)}"
    trl_log, grpo_log = trl["log_history"], grpo["log_history"]
    assert [e.get("step") for e in grpo_log] == [e.get("step") for e in trl_log]
    for index, (trl_entry, grpo_entry) in enumerate(zip(trl_log, grpo_log)):
        assert not missing_keys(trl_entry, grpo_entry), (
            f"log_history[{index}] (step {trl_entry.get('step')}) lacks TRL's keys "
            f"{missing_keys(trl_entry, grpo_entry)}")
        check_eval_loss(trl_entry, grpo_entry)
        for key in SAME_VALUE:  # a value the run's settings decide, not its samples
            if key in trl_entry:
                assert grpo_entry[key] == pytest.approx(trl_entry[key]), (index, key, grpo_entry[key], trl_entry[key])
    if "evaluate" in trl:
        assert not missing_keys(trl["evaluate"], grpo["evaluate"]), "evaluate() lacks TRL's keys"
        check_eval_loss(trl["evaluate"], grpo["evaluate"])
