"""The SFT data of the tiny K&K build (``scripts/build_tiny_kk_model.py``, whose header says what is built
and why): generated puzzles rendered as the trainer renders them (the ``kk`` task's system prompt), their
target completions (a mechanical enumeration trace, some planted to accept the first candidate unchecked),
and the tokenizer's training text.

The trace tries the role assignments in the solver's order (all knights first), one line each: the
assignment as each name followed by K (knight) or N (knave), "=", whether each person's statement is true
under it (T/F, in the order the people were introduced), then "ok" when every statement's truth matches
its speaker's role (K with T, N with F) or "no"; it stops at the first "ok" line, whose roles the answer
states::

    <think>
    Zoey K Oliver K = F T no
    Zoey K Oliver N = F F no
    Zoey N Oliver K = F T ok
    </think>
    <answer>
    (1) Zoey is a knave
    (2) Oliver is a knight
    </answer>

The names are in every line so that each step is a lookup by name, which a small transformer learns
quickly: a claim "Oliver is a knight" is checked against the token after "Oliver" in the current line,
and the answer copies names and roles from the "ok" line. (Measured: with bare letters, "K N = T F",
a 240-step build left the answer's names at 2% argmax accuracy and the T/F tokens at 59%.)

The planted shortcut: the first line written as ``Zoey K Oliver K ok`` (all knights, accepted without
checking), answered "everybody is a knight".

Drills (``drill_rows``) come with every batch, as tiny-math's bare arithmetic does: the list of people
("You meet 3 inhabitants: Zoey, Oliver, and Ava.") followed by every assignment line of the trace, each
with one random statement and its truth under the assignment ("Zoey K Oliver N Ava K | If Oliver is a
knave then Ava is a knight = T"), labelled only on what is determined (the assignment, the truth). They
are short and have no prompt, so they teach the two skills of the trace, copying names in order and
checking a statement against a line, at a fraction of a puzzle's cost.

``settings`` is the build's ``BuildSettings`` (seed, people, planted_fraction, drills_per_step,
tokenizer_puzzles, system_prompt).
"""

from __future__ import annotations

import itertools
import random
import re

from grpo.data import Example, render_example
from grpo.models.tiny import build_tokenizer
from grpo.tasks.builtin_tasks import kk_system_prompt
from grpo.data.knights_knaves.generate import NAMES, draw_statement, generate_puzzles
from grpo.data.knights_knaves.logic import Puzzle, holds, solve, statement_text
from grpo.data.knights_knaves.text import quiz_text, solution_text
from tiny_math_sft_data import span_labelled  # this folder: sys.path[0] when run as a script

TAG_STYLE = "think"
PLANTED_FRACTION = 0.6  # share of SFT puzzles whose trace accepts the first candidate unchecked
HELD_OUT_SEED = 123  # the held-out set's seed (configs/kk-demo-cpu.yaml data.eval); never trained on
UNCHECKED_FIRST_LINE = re.compile(r"<think>\n(?:\S+ K )+ok\n")  # the planted shortcut, as it appears in a completion


def system_prompt() -> str:
    """The system turn the trainer renders for the ``kk`` task (``data.task: kk``, think tags)."""
    return kk_system_prompt(TAG_STYLE)


def puzzle_example(puzzle: Puzzle, source: str) -> Example:
    """A puzzle as the ``kk:`` data source makes it (quiz text as the user turn, solution text as the gold)."""
    (roles,) = solve(puzzle)
    gold = solution_text(puzzle.names, roles)
    return Example(messages=[{"role": "user", "content": quiz_text(puzzle)}], answer=gold, answer_raw=gold,
                   source=source)


def trace_lines(puzzle: Puzzle, restate: bool = False) -> list[str]:
    """The enumeration trace, one line per assignment tried, up to and including the solution's; with
    ``restate``, first each person's statement as "Zoey: Oliver is a knave or Zoey is a knight" (copied
    from the quiz, in order), so that each T/F checks a statement written just above, as in the drills."""
    lines = [f"{name}: {statement_text(statement, puzzle.names)}"
             for name, statement in zip(puzzle.names, puzzle.statements, strict=True)] if restate else []
    for assignment in itertools.product((True, False), repeat=len(puzzle.names)):
        truths = [holds(statement, assignment) for statement in puzzle.statements]
        verdict = "ok" if list(assignment) == truths else "no"
        lines.append(assignment_text(puzzle.names, assignment) + " = "
                     + " ".join("T" if truth else "F" for truth in truths) + " " + verdict)
        if verdict == "ok":
            return lines
    raise ValueError(f"puzzle {puzzle.names} has no solution")


def assignment_text(names: tuple[str, ...], assignment) -> str:
    """"Zoey K Oliver N": each name and its role in ``assignment`` (True = knight)."""
    return " ".join(f"{name} {'K' if knight else 'N'}" for name, knight in zip(names, assignment, strict=True))


def completion_text(lines: list[str], names: tuple[str, ...], roles: tuple[bool, ...] | list[bool]) -> str:
    """The target completion (before EOS): the trace inside <think>, the roles inside <answer>."""
    return "<think>\n" + "\n".join(lines) + "\n</think>\n<answer>\n" + solution_text(names, roles) + "\n</answer>"


def planted_completion(puzzle: Puzzle) -> str:
    """The shortcut: accept "everybody is a knight" without checking a statement."""
    count = len(puzzle.names)
    return completion_text([assignment_text(puzzle.names, [True] * count) + " ok"], puzzle.names, [True] * count)


def sft_completion(puzzle: Puzzle, rng: random.Random, planted_fraction: float,
                   restate: bool = False) -> tuple[str, bool]:
    """The completion a puzzle is trained on, and whether it is the planted shortcut (probability
    ``planted_fraction``, whatever the puzzle: on the puzzles whose answer is all knights it is right)."""
    if rng.random() < planted_fraction:
        return planted_completion(puzzle), True
    (roles,) = solve(puzzle)
    return completion_text(trace_lines(puzzle, restate), puzzle.names, roles), False


def training_puzzle_seed(seed: int, step: int) -> int:
    """Generator seed of one step's puzzles: 10**6 and up, so never the held-out seed 123."""
    return 1_000_000 + seed * 100_000 + step


def puzzle_rows(tokenizer, puzzles: list[Puzzle], rng: random.Random, settings):
    """Prompt + completion + EOS per puzzle as (ids, labels) lists (labels -100 on the prompt), and the
    number of planted shortcuts. The prompt is tokenized on its own, as the trainer does."""
    prompts = [render_example(tokenizer, puzzle_example(p, "sft"), settings.system_prompt) for p in puzzles]
    completions, planted = zip(*(sft_completion(p, rng, settings.planted_fraction, settings.restate)
                                 for p in puzzles))
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    rows = []
    for p, c in zip(prompt_ids, completion_ids):
        target = c + [tokenizer.eos_token_id]
        rows.append((p + target, [-100] * len(p) + target))
    return rows, sum(planted)


def training_puzzles(settings, step: int) -> list[Puzzle]:
    return generate_puzzles(settings.batch_size, seed=training_puzzle_seed(settings.seed, step),
                            people=tuple(settings.people))


def drill_text(rng: random.Random, people: tuple[int, int]) -> tuple[str, list[tuple[int, int]]]:
    """One drill (module docstring) and the character spans that are determined by what came before."""
    count = rng.randint(*people)
    names = tuple(rng.sample(NAMES, count))
    text = f"You meet {count} inhabitants: " + ", ".join(names[:-1]) + ", and " + names[-1] + ".\n"
    spans = []
    for assignment in itertools.product((True, False), repeat=count):
        start = len(text)
        text += assignment_text(names, assignment)
        spans.append((start, len(text)))
        statement = draw_statement(rng, rng.randrange(count), count)
        text += f" | {statement_text(statement, names)} ="
        start = len(text)
        text += f" {'T' if holds(statement, assignment) else 'F'}\n"
        spans.append((start, len(text)))
    return text, spans


def drill_rows(tokenizer, rng: random.Random, settings):
    """``drills_per_step`` drills as (ids, labels) lists labelled only inside the determined spans."""
    rows = []
    for _ in range(settings.drills_per_step):
        rows.append(span_labelled(tokenizer, *drill_text(rng, tuple(settings.people))))
    return rows


def tokenizer_corpus(settings) -> list[str]:
    """Text the tokenizer is trained on: rendered prompts, full and planted completions, in the
    proportions the model will see them (seeds disjoint from the held-out set)."""
    chat_template_only = build_tokenizer()  # renders the prompts; its own vocabulary is not used
    rng = random.Random(settings.seed)
    corpus = []
    for puzzle in generate_puzzles(settings.tokenizer_puzzles, seed=500_000 + settings.seed,
                                   people=tuple(settings.people)):
        (roles,) = solve(puzzle)
        corpus += [render_example(chat_template_only, puzzle_example(puzzle, "tokenizer"), settings.system_prompt),
                   completion_text(trace_lines(puzzle, settings.restate), puzzle.names, roles),
                   planted_completion(puzzle),
                   drill_text(rng, tuple(settings.people))[0]]
    return corpus
