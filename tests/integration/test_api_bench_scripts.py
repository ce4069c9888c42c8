"""benchmarks/api_vs_trl.py's cases: its command list names scripts that exist, and the short TRL scripts it
times (benchmarks/scripts/) run under grpo with TRL's flags and print TRL's log_history. The GSM8K example is
run under both libraries by test_python_api.py; the benchmark runs every script under TRL too."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "api_vs_trl.py"


def test_dry_run_lists_both_sides_of_every_case_and_the_scripts_exist():
    result = subprocess.run([sys.executable, str(BENCH), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    commands = [line.split() for line in result.stdout.splitlines()]
    scripts = {Path(c[1]).relative_to(REPO).as_posix() for c in commands}
    assert scripts == {"examples/grpo_gsm8k_unsloth.py", "benchmarks/scripts/text_prompts.py",
                       "benchmarks/scripts/tools_lora.py", "benchmarks/scripts/loss_variants.py"}
    assert all((REPO / s).is_file() for s in scripts)
    gsm8k_steps = {c[c.index("--max-steps") + 1] for c in commands if c[1].endswith("grpo_gsm8k_unsloth.py")}
    assert gsm8k_steps == {"3", "20"}  # the notebook's recipe short, as a notebook user runs it, and long
    assert sum(c[-1] == "--trl" for c in commands) == len(commands) // 2


def run_script(name: str, steps: int, out: Path, *extra: str) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scripts" / name), "--max-steps", str(steps),
                             "--output-dir", str(out), *extra], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [ast.literal_eval(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_the_text_prompt_script_runs_under_grpo(tmp_path):
    history = run_script("text_prompts.py", 2, tmp_path)
    assert [e["step"] for e in history if "loss" in e] == [1, 2]
    assert all({"rewards/reward_len/mean", "rewards/reward_answer/mean"} <= set(e) for e in history if "loss" in e)
    assert history[-1]["step"] == 2 and "train_runtime" in history[-1]


@pytest.mark.slow
def test_the_tools_lora_script_runs_under_grpo(tmp_path):
    history = run_script("tools_lora.py", 2, tmp_path)  # num_iterations=2: one generation, two updates
    assert history[-1]["step"] == 2 and "train_runtime" in history[-1]
    assert any("rewards/correctness/mean" in e for e in history)


# what each recipe adds to TRL's log (TRL's own keys), so a recipe's field that grpo dropped shows here
RECIPE_KEYS = {"gspo": set(), "dapo-80-20": set(), "cispo": {"cispo_clip_ratio", "entropy_coef", "policy_loss"},
               "sapo": {"kl"}, "no-save": set(), "sync-ref": {"kl"}, "optimizers": {"learning_rate"}}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPE_KEYS))
def test_the_loss_variant_recipes_run_under_grpo(tmp_path, recipe):
    steps = 4 if recipe == "gspo" else 2  # gspo's steps_per_generation=4: four updates a generation
    history = run_script("loss_variants.py", steps, tmp_path, "--recipe", recipe)
    updates = [e for e in history if "loss" in e]
    assert [e["step"] for e in updates] == list(range(1, steps + 1)) and "train_runtime" in history[-1]
    assert all(RECIPE_KEYS[recipe] <= set(e) for e in updates), recipe
    checkpoints = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    if recipe == "no-save":
        assert checkpoints == [], checkpoints
    else:  # TRL's save_strategy="steps" saves at the last step
        assert checkpoints == [f"checkpoint-{steps}"], checkpoints
