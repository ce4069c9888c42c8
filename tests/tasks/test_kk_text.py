"""K&K text: the quiz as the benchmark words it, the canonical solution text, and reading roles back."""

from __future__ import annotations

import pytest

from grpo.data.knights_knaves import Iff, Is, Not, Puzzle, parse_roles, quiz_text, solution_roles, solution_text

NAMES = ("Zoey", "Oliver")


def test_quiz_reads_like_the_benchmark():
    # The first quiz of the benchmark's test/people2 file, rebuilt from its statements and sayings.
    puzzle = Puzzle(names=NAMES, statements=(Not(Is(1, "knight")), Iff(Is(1, "knight"), Is(0, "knave"))),
                    sayings=('{name} remarked, "{content}".', '{name} stated, "{content}".'))
    assert quiz_text(puzzle) == (
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and "
        "knaves always lie. You meet 2 inhabitants: Zoey, and Oliver. Zoey remarked, \"Oliver is not a knight\". "
        "Oliver stated, \"Oliver is a knight if and only if Zoey is a knave\". So who is a knight and who is a knave?")


def test_quiz_without_sayings_uses_the_plain_one():
    puzzle = Puzzle(names=("Zoey", "Oliver", "Emma"), statements=(Is(1, "knight"), Is(2, "knave"), Is(0, "knight")))
    assert quiz_text(puzzle).endswith(
        "You meet 3 inhabitants: Zoey, Oliver, and Emma. Zoey said, \"Oliver is a knight.\" Oliver said, "
        "\"Emma is a knave.\" Emma said, \"Zoey is a knight.\" So who is a knight and who is a knave?")


def test_solution_text_round_trips():
    text = solution_text(NAMES, (True, False))
    assert text == "(1) Zoey is a knight\n(2) Oliver is a knave"
    assert solution_roles(text) == {"Zoey": True, "Oliver": False}
    assert list(solution_roles(text)) == ["Zoey", "Oliver"]  # in order


@pytest.mark.parametrize("bad", ["", "(1) Zoey is a knight\n(3) Oliver is a knave", "Zoey is a knight",
                                 "(1) Zoey is a knight\n(2) Zoey is a knave", "(1) Zoey is a squire"])
def test_solution_roles_refuses_anything_else(bad):
    with pytest.raises(ValueError, match="K&K solution"):
        solution_roles(bad)


@pytest.mark.parametrize("answer", [
    "(1) Zoey is a knight\n(2) Oliver is a knave",  # the canonical numbered list
    "1. Zoey is a knight\n2. Oliver is a knave",
    "- Zoey is a knight\n- Oliver is a knave",  # bullets
    "Zoey is a knight, and Oliver is a knave.",  # prose
    "So Oliver is a knave and Zoey is a knight.",  # any order
    "ZOEY IS A KNIGHT; oliver is a Knave",  # case-insensitive
    "**Zoey** is a **knight**\n**Oliver** is a **knave**",  # markdown bold
    "Zoey is a knight (she tells the truth). Oliver is a knave. Zoey is a knight.",  # a repeat agrees
])
def test_parse_roles_reads_claims(answer):
    assert parse_roles(answer, NAMES) == {"Zoey": True, "Oliver": False}


@pytest.mark.parametrize("answer", [
    "(1) Zoey is a knight",  # Oliver missing
    "Zoey is a knight. Oliver is not a knight.",  # a negation is no claim
    "Zoey is a knight, Oliver is a knave, and Zoey is a knave.",  # contradictory
    "",
])
def test_parse_roles_none_without_one_claim_each(answer):
    assert parse_roles(answer, NAMES) is None


def test_parse_roles_matches_whole_names():
    # "Ava" must not be read out of "Avery is a knight".
    assert parse_roles("Avery is a knight. Ava is a knave.", ("Ava", "Avery")) == {"Ava": False, "Avery": True}
    assert parse_roles("Avery is a knight.", ("Ava", "Avery")) is None
