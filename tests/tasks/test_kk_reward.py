"""The Logic-RL rule reward ``kk_logic`` (format +1/-1, answer +2/-1.5/-2) and per-person accuracy."""

from __future__ import annotations

import pytest

from grpo.rewards import get_reward_function, list_rewards
from grpo.rewards.context import RewardContext
from grpo.rewards.knights_knaves import per_person_accuracy

GOLD = "(1) Zoey is a knight\n(2) Oliver is a knave"
RIGHT = "(1) Zoey is a knight\n(2) Oliver is a knave"
ONE_WRONG = "Zoey is a knight, and Oliver is a knight."


def _score(completion: str, gold: str = GOLD, **kwargs) -> float:
    reward = get_reward_function("kk_logic", **kwargs)
    (value,) = reward(prompts=["quiz"], completions=[completion], answer=[gold])
    return value


@pytest.mark.parametrize(("completion", "expected"), [
    (f"<think>Zoey's claim holds.</think>\n<answer>\n{RIGHT}\n</answer>", 3.0),  # +1 format, +2 answer
    (f"<think>...</think><answer>{ONE_WRONG}</answer>", -0.5),  # +1 format, -1.5 answer
    ("Zoey is a knight and Oliver is a knave.", -3.0),  # -1 format, -2 no answer tag
    ("<think>...</think><answer>Zoey is a knight.</answer>", -1.0),  # +1 format, -2 Oliver has no role
    ("<think>...</think><answer>Zoey is a knight, Oliver is a knave, Oliver is a knight</answer>", -1.0),
    (f"Sure! <answer>{RIGHT}</answer>", 1.0),  # -1 format (no think), +2: judged apart
    (f"<think>a</think><answer>x</answer><answer>{ONE_WRONG}</answer>", -2.5),  # two answers: -1, last one read
])
def test_scores(completion, expected):
    assert _score(completion) == expected


def test_chat_completions_and_the_reasoning_style():
    reward = get_reward_function("kk_logic", tag_style="reasoning")
    completion = [{"role": "assistant", "content": f"<reasoning>r</reasoning><answer>{RIGHT}</answer>"}]
    assert reward(prompts=[[]], completions=[completion], answer=[GOLD]) == [3.0]
    assert _score(f"<think>r</think><answer>{RIGHT}</answer>", tag_style="reasoning") == 1.0  # wrong tags: -1 + 2


def test_logs_per_person_accuracy_and_needs_the_answer_column():
    context = RewardContext()
    reward = get_reward_function("kk_logic")
    completions = [f"<think>.</think><answer>{RIGHT}</answer>", f"<think>.</think><answer>{ONE_WRONG}</answer>"]
    assert reward(prompts=["q", "q"], completions=completions, answer=[GOLD, GOLD], **context.keywords()) == [3.0, -0.5]
    assert context.metric_means() == {"kk_logic/per_person_accuracy": 0.75}
    with pytest.raises(ValueError, match="needs the dataset column 'answer'"):
        reward(prompts=["q"], completions=["x"], question=["q"])
    with pytest.raises(ValueError, match="K&K solution line 1"):
        reward(prompts=["q"], completions=["x"], answer=["Zoey"])  # a gold that is not a solution text


def test_per_person_accuracy():
    assert per_person_accuracy(f"<think>.</think><answer>{RIGHT}</answer>", GOLD) == 1.0
    assert per_person_accuracy(f"<answer>{ONE_WRONG}</answer>", GOLD) == 0.5
    assert per_person_accuracy("<answer>Oliver is a knave</answer>", GOLD) == 0.5  # Zoey missing: wrong
    assert per_person_accuracy("<answer>Zoey is a knight or a knave; Zoey is a knave</answer>", GOLD) == 0.0
    assert per_person_accuracy(RIGHT, GOLD) == 0.0  # no answer tag


def test_registered_as_a_builtin():
    assert "kk_logic" in list_rewards()
    assert get_reward_function("kk_logic").__name__ == "kk_logic"
    with pytest.raises(ValueError, match="bad parameters"):
        get_reward_function("kk_logic", weight_of_format=2)
