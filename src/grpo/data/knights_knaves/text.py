"""The K&K benchmark's words: the quiz a model reads, the solution text it is graded against, and
``parse_roles``, which reads "X is a knight/knave" claims back out of an answer.

The quiz is the benchmark's (Xie et al.; its ``quiz`` column), e.g.

    A very special island is inhabited only by knights and knaves. Knights always tell the truth, and
    knaves always lie. You meet 2 inhabitants: Zoey, and Oliver. Zoey said, "Oliver is not a knight."
    Oliver stated, "Oliver is a knight if and only if Zoey is a knave". So who is a knight and who is a knave?

and the solution its ``solution_text_format`` column: ``"(1) Zoey is a knave\\n(2) Oliver is a knight"``.
"""

from __future__ import annotations

import functools
import re

from grpo.data.knights_knaves.logic import Puzzle, statement_text

INTRODUCTION = ("A very special island is inhabited only by knights and knaves. "
                "Knights always tell the truth, and knaves always lie.")
QUESTION = "So who is a knight and who is a knave?"

# The benchmark's ways of introducing a statement ({name} says {content}); its punctuation quirks kept
# (a full stop inside the quotes for some, outside for others) so generated quizzes read like its files.
SAYINGS = (
    '{name} said that {content}.',
    '{name} told you that {content}.',
    '{name} said, "{content}."',
    '{name} stated, "{content}".',
    'According to {name}, "{content}".',
    '''In {name}'s words: "{content}".''',
    '{name} remarked, "{content}".',
    '"{content}," {name} declared.',
    '{name} was heard saying, "{content}".',
    '{name} expressed that {content}.',
    '"{content}" - {name}.',
    'As {name} put it, "{content}".',
    '{name} asserted: "{content}".',
    '"{content}," {name} mentioned.',
    '{name} commented, "{content}".',
    'In a statement by {name}: "{content}".',
    '{name} noted, "{content}".',
    '"{content}," {name} claimed.',
)
PLAIN_SAYING = SAYINGS[2]

# "(1) Zoey is a knight": one line of the canonical solution text.
_SOLUTION_LINE = re.compile(r"\((\d+)\) (\S(?:.*\S)?) is a (knight|knave)")


def quiz_text(puzzle: Puzzle) -> str:
    """The quiz for a puzzle, worded as the benchmark's ``quiz`` column (each statement introduced
    by the puzzle's saying, ``PLAIN_SAYING`` when it has none)."""
    names = puzzle.names
    sayings = puzzle.sayings or (PLAIN_SAYING,) * len(names)
    # "Zoey, and Oliver" for two people is the benchmark's (it always writes ", and" before the last name).
    people = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
    parts = [INTRODUCTION, f"You meet {len(names)} inhabitant{'s' if len(names) != 1 else ''}: {people}."]
    for name, saying, statement in zip(names, sayings, puzzle.statements, strict=True):
        parts.append(saying.format(name=name, content=statement_text(statement, names)))
    parts.append(QUESTION)
    return " ".join(parts)


def solution_text(names: tuple[str, ...] | list[str], roles: tuple[bool, ...] | list[bool]) -> str:
    """The canonical answer, one numbered line per person: ``"(1) Zoey is a knight\\n(2) Oliver is a knave"``."""
    if len(names) != len(roles):
        raise ValueError(f"{len(names)} names but {len(roles)} roles")
    return "\n".join(f"({i}) {name} is a {'knight' if knight else 'knave'}"
                     for i, (name, knight) in enumerate(zip(names, roles, strict=True), start=1))


def solution_roles(text: str) -> dict[str, bool]:
    """Read a canonical solution text (``solution_text``) back: name -> True for a knight, in order.

    Raises ValueError, quoting the line, when a line is not "(i) Name is a knight/knave" with i
    counting from 1, or a name repeats: a gold answer must never be half-read."""
    roles: dict[str, bool] = {}
    lines = [line.strip() for line in text.strip().splitlines()]
    for expected, line in enumerate(lines, start=1):
        match = _SOLUTION_LINE.fullmatch(line)
        if match is None or int(match[1]) != expected or match[2] in roles:
            raise ValueError(f"K&K solution line {expected} must read '({expected}) Name is a knight' or "
                             f"'... is a knave' with a new name, got {line!r}")
        roles[match[2]] = match[3] == "knight"
    if not roles:
        raise ValueError(f"K&K solution text is empty: {text!r}")
    return roles


def parse_roles(text: str, names: tuple[str, ...] | list[str]) -> dict[str, bool] | None:
    """Each name's role as claimed in ``text`` (True = knight), or None when some name has no claim or
    has both. A claim is "<name> is a knight" / "<name> is a knave", matched case-insensitively
    anywhere (so numbering, bullets, commas, "and" and markdown bold around it do not matter);
    "Zoey is not a knight" is no claim."""
    claims = role_claims(text, names)
    if any(len(claimed) != 1 for claimed in claims.values()):
        return None
    return {name: next(iter(claimed)) for name, claimed in claims.items()}


def role_claims(text: str, names: tuple[str, ...] | list[str]) -> dict[str, set[bool]]:
    """name -> the set of roles ``text`` claims for it (empty: none; ``{True, False}``: contradictory)."""
    return {name: {m[1].lower() == "knight" for m in _claim_pattern(name).finditer(text)} for name in names}


@functools.lru_cache(maxsize=256)
def _claim_pattern(name: str) -> re.Pattern[str]:
    # The whole name (so "Ava" is not read out of "Avalon"; "[^\W_]" is a letter or digit), optional
    # markdown emphasis (** or _) around the name and the role, an optional "a"/"an".
    return re.compile(rf"(?<![^\W_]){re.escape(name)}(?![^\W_])[*_]*\s+is\s+(?:an?\s+)?[*_]*(knight|knave)(?![^\W_])",
                      re.IGNORECASE)
