"""A user's own task by dotted path: the shipped example (examples/tasks/reverse_words.py, the worked
example) loads its own data source, scores and rewards its answers; a recipe naming it with ``data.task`` and no
rewards trains 2 steps with the tiny CPU model through ``grpo train`` and its own rewards, and ``grpo eval`` of
the run scores with the task's scorer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from grpo.data import DataError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "tasks"


@pytest.fixture
def reverse_words(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import reverse_words

    return reverse_words


def test_the_example_loads_its_own_source(reverse_words):
    examples = reverse_words.load("reverse:seed=1,n=6,words=3-4", "train", None)
    assert len(examples) == 6 and examples == reverse_words.load("reverse:seed=1,n=6,words=3-4", "test", None)
    assert reverse_words.load("reverse:seed=1,n=6,words=3-4", "train", 2) == examples[:2]  # limit: the first N
    assert examples != reverse_words.load("reverse:seed=2,n=6,words=3-4", "train", None)
    for example in examples:
        words = example.question.removeprefix("Reverse the order of these words: ").split()
        assert example.answer == " ".join(reversed(words)) and 3 <= len(words) <= 4
        assert reverse_words.word_count(example) == f"words={len(words)}"
    for bad in ("reverse:seed=1", "reverse:seed=x,n=2", "reverse:seed=1,n=2,colour=red", "reverse:seed=1,n=2,words=1",
                "synthetic:seed=1,n=2"):
        with pytest.raises(DataError, match="reverse:seed=S,n=N"):
            reverse_words.load(bad, "train", None)


def test_the_example_scores_and_rewards_its_answers(reverse_words):
    task = reverse_words.task
    right = "<think>\nback to front\n</think>\n<answer>\nStone, River, apple\n</answer>"
    assert task.score(right, "stone river apple", "think") == {
        "prediction": "stone river apple", "correct": True, "formatted": True}
    assert task.score("<answer>stone apple river</answer>", "stone river apple", "think") == {
        "prediction": "stone apple river", "correct": False, "formatted": False}
    assert task.score("<answer>42</answer>", "stone river apple", "think")["prediction"] is None
    assert "<reasoning>" in task.system_prompt("reasoning") and "reverse order" in task.system_prompt("think")
    completions = [[{"role": "assistant", "content": text}] for text in
                   (right, "<answer>stone apple river</answer>", "no answer")]
    # exact: 1; one position of three right: 0.5 * 1/3; no answer: 0
    assert reverse_words.reversed_words(completions, ["stone river apple"] * 3) == pytest.approx([1.0, 1 / 6, 0.0])
    assert task.rewards == (("reverse_words:reversed_words", 1.0), ("format_think_answer", 0.5))


def test_the_docs_show_the_example_file():
    page = (REPO / "docs" / "guides" / "tasks.md").read_text()
    block = page[page.index("<!-- task-example:begin -->"):page.index("<!-- task-example:end -->")]
    assert block.split("```python\n", 1)[1].split("```", 1)[0] == (EXAMPLES / "reverse_words.py").read_text()


# ---------------------------------------------------------------- trained and evaluated from a recipe

# The test's task is the example with a scorer that calls every completion right (GSM8K's numeric check, what
# `grpo eval` used before tasks, would call them wrong: the golds are words), so the eval report says which
# scorer ran whatever the 2-step model writes.
JUDGED_TASK = '''
import dataclasses
from reverse_words import task as reverse_words


def judge(text, gold, tag_style):
    return {"prediction": gold.split()[0], "correct": True, "formatted": True}


task = dataclasses.replace(reverse_words, name="reverse_words_judged", score=judge)
'''


def _grpo(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(EXAMPLES), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "grpo", *map(str, args)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """``grpo train`` of a recipe naming the user's task, with its own data source and no rewards."""
    folder = tmp_path_factory.mktemp("user-task")
    (folder / "judged_reverse_words.py").write_text(JUDGED_TASK)
    recipe = folder / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        # 2 steps of a user's task on CPU: grpo train recipe.yaml
        model: {{name_or_path: {REPO / 'assets' / 'tiny-math'}, lora_r: 0}}
        data:
          task: judged_reverse_words:task
          train: reverse:seed=1,n=16,words=3
          eval: reverse:seed=2,n=4,words=3
        rollout: {{num_generations: 4, max_completion_length: 16}}
        train: {{prompts_per_step: 2, micro_batch_size: 8, max_steps: 2, save_steps: 2, output_dir: {folder / 'run'}}}
        log: {{report_to: [], progress_bar: false, plots: false}}
        """))
    done = _grpo(folder, "train", recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


@pytest.mark.integration
@pytest.mark.slow
def test_a_users_task_trains_from_a_recipe_with_its_rewards(trained_run):
    saved = yaml.safe_load((trained_run / "config.yaml").read_text())
    assert saved["data"]["task"] == "judged_reverse_words:task"
    assert [(r["name"], r["weight"]) for r in saved["rewards"]] == [
        ("reverse_words:reversed_words", 1.0), ("format_think_answer", 0.5)]
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("reward/reversed_words" in r and "reward/format_think_answer" in r for r in steps)
    samples = [json.loads(line) for line in (trained_run / "samples.jsonl").read_text().splitlines()]
    # the prompts and golds are the task's own loader's
    assert samples and all(s["prompt"].startswith("Reverse the order of these words: ") and
                           s["source"].startswith("reverse:seed=1,n=16,words=3#") for s in samples)
    assert (trained_run / "final" / "model.safetensors").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_grpo_eval_of_the_run_scores_with_the_tasks_scorer(trained_run, tmp_path):
    report_path = tmp_path / "eval.json"
    done = _grpo(trained_run.parent, "eval", trained_run, "--output", report_path, "--max-new-tokens", 16,
                 "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["n"] == 4 and report["data"] == "reverse:seed=2,n=4,words=3"
    assert report["accuracy"] == 1.0 and report["format_rate"] == 1.0  # the judged task's scorer, not GSM8K's
