"""The task registry: built-in tasks by data source, a user's task by dotted path, and each scorer."""

import sys
import types

import pytest

from grpo.tasks import Task, resolve_task, task_for_source, task_names


def test_builtin_task_by_data_source():
    assert task_for_source("kk:seed=1,n=3") == "kk"
    assert task_for_source("synthetic:seed=1,n=3") == "arithmetic"
    assert task_for_source("arithmetic-tools:seed=1,n=3") == "arithmetic"
    assert task_for_source("openai/gsm8k") == "gsm8k"
    assert task_for_source("prompts:path=x.jsonl") == "gsm8k"
    assert task_for_source("C:/data/gsm8k") == "gsm8k"  # a colon that is no source kind
    assert set(task_names()) >= {"gsm8k", "arithmetic", "kk"}
    assert resolve_task(None, "kk:seed=1,n=3").name == "kk"
    assert resolve_task("arithmetic").name == "arithmetic"


def test_numeric_score_and_vote_equality():
    task = resolve_task("gsm8k")
    score = task.score("<think>\n2 + 2 = 4\n</think>\n<answer>\n1,080\n</answer>", "1080", "think")
    assert score == {"prediction": "1,080", "correct": True, "formatted": True}
    assert task.score("no tags 1080", "1080", "think") == {"prediction": None, "correct": False, "formatted": False}
    assert task.same_answer("1,080", "1080.0") and not task.same_answer(None, "1080")


def test_kk_score_reads_roles_and_groups_by_people():
    task = resolve_task("kk")
    (example,) = task.load("kk:seed=3,n=1,people=3", "train", None)
    gold = example.answer
    assert task.group_of(example) == "people=3"
    # the claims in any order and wording give the canonical text, so two such answers are one maj@k vote
    names = [line.split(") ")[1].split(" is a ")[0] for line in gold.splitlines()]
    roles = ["knight" in line for line in gold.splitlines()]
    loose = ", ".join(f"**{n}** is a {'knight' if r else 'knave'}" for n, r in reversed(list(zip(names, roles))))
    score = task.score(f"<think>\nok\n</think>\n<answer>\n{loose}\n</answer>", gold, "think")
    assert score == {"prediction": gold, "correct": True, "formatted": True}
    wrong = gold.replace("knight", "KNAVE_").replace("knave", "knight").replace("KNAVE_", "knave")
    assert task.score(f"<answer>{wrong}</answer>", gold, "think") == {"prediction": wrong, "correct": False,
                                                                      "formatted": False}
    assert task.score("<answer>nobody</answer>", gold, "think")["prediction"] is None
    assert "(1) Zoey is a knight" in task.system_prompt("reasoning") and "<reasoning>" in task.system_prompt("reasoning")


def _user_task() -> Task:
    return Task(name="echo", load=lambda source, split, limit: [], system_prompt=lambda style: "say it",
                score=lambda text, gold, style: {"prediction": text, "correct": text == gold, "formatted": True},
                rewards=(("answer_correct", 1.0),))


def test_user_task_by_dotted_path(monkeypatch):
    module = types.ModuleType("user_tasks_for_test")
    module.factory = _user_task
    module.instance = _user_task()
    module.not_a_task = 3
    monkeypatch.setitem(sys.modules, "user_tasks_for_test", module)
    assert resolve_task("user_tasks_for_test:factory").name == "echo"
    assert resolve_task("user_tasks_for_test:instance").name == "echo"
    with pytest.raises(ValueError, match="not a grpo.tasks.Task"):
        resolve_task("user_tasks_for_test:not_a_task")
    with pytest.raises(ValueError, match="has no 'missing'"):
        resolve_task("user_tasks_for_test:missing")
    with pytest.raises(ValueError, match="does not import"):
        resolve_task("no_such_module_xyz:task")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        resolve_task("nope")


def test_task_record_checks_its_fields():
    with pytest.raises(TypeError, match="score must be callable"):
        Task(name="bad", load=lambda *a: [], system_prompt=lambda s: "", score="x", rewards=())
    with pytest.raises(TypeError, match="rewards must be"):
        Task(name="bad", load=lambda *a: [], system_prompt=lambda s: "", score=lambda *a: {}, rewards=("r",))


def test_training_accuracy_reads_the_tasks_scorer():
    """step.metrics.correctness (the logged accuracy and format rate) with a task's scorer: a K&K answer that is
    right by its roles counts, which the numeric check (no scorer) cannot see."""
    from grpo.step.metrics import correctness

    task = resolve_task("kk")
    (example,) = task.load("kk:seed=3,n=1,people=2", "train", None)
    gold = example.answer
    right = f"<think>\nok\n</think>\n<answer>\n{gold}\n</answer>"
    wrong = right.replace("knight", "KNAVE_").replace("knave", "knight").replace("KNAVE_", "knave")
    completions, golds = [right, wrong, "no tags", right], [gold, gold, gold, None]
    correct, formatted = correctness(completions, golds, "think", task.score)
    assert correct.tolist() == [True, False, False, False]  # no gold: not correct
    assert formatted.tolist() == [True, True, False, True]  # no gold: the format is still checked
    numeric_correct, numeric_formatted = correctness(completions, golds, "think")
    assert numeric_correct.tolist() == [False] * 4 and numeric_formatted.tolist() == formatted.tolist()
