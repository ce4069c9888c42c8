"""Wording for the synthetic word problems: people, themes and one sentence pair per operation.

Data only; the arithmetic lives in `grpo.data.synthetic`. Each theme follows one running quantity
(apples held, dollars held, km from home, baked goods kept) through a chain of operations:
- a *start* sentence introduces two numbers ``a`` and ``b`` and gives the first result;
- each *follow* sentence applies one more number ``b`` to the current value ``x``.
Every operation has a question sentence and a solution sentence; the solution sentence holds the
equation exactly as ``"{left} {op} {right} = {result}"`` so that it can be checked mechanically.

Template fields: name, friend, P/p (He/he), poss (his), obj (him), a, b, x, r, plus the
theme's own vocabulary fields (e.g. job, thing), filled by the generator.
"""

from __future__ import annotations

from dataclasses import dataclass

# (name, subject pronoun); the other pronoun forms come from PRONOUNS.
PEOPLE: tuple[tuple[str, str], ...] = (
    ("Tom", "he"), ("Maria", "she"), ("Liam", "he"), ("Aisha", "she"), ("Kenji", "he"), ("Sofia", "she"),
    ("Omar", "he"), ("Emma", "she"), ("Diego", "he"), ("Priya", "she"), ("Lucas", "he"), ("Chloe", "she"),
    ("Noah", "he"), ("Fatima", "she"), ("Ivan", "he"), ("Mei", "she"),
)

# subject -> (possessive, object)
PRONOUNS: dict[str, tuple[str, str]] = {"he": ("his", "him"), "she": ("her", "her")}


@dataclass(frozen=True)
class Sentence:
    """One operation's wording: what the question says and what the solution says."""

    question: str
    solution: str


@dataclass(frozen=True)
class Theme:
    """A story around one running quantity; `start`/`follow` map an op symbol to its wording."""

    name: str
    ask: str  # the final question
    start: dict[str, Sentence]
    follow: dict[str, Sentence]
    vocabulary: dict[str, tuple[str, ...]]  # field -> choices (e.g. "item" -> apples, marbles, ...)
    # Fields drawn again at every step ("earns $5 mowing lawns ... earns $7 babysitting"); the
    # others stay fixed for the whole story, since the running quantity is about one item.
    per_step: tuple[str, ...] = ()


COLLECTION = Theme(
    name="collection",
    ask="How many {item} does {name} have now?",
    start={
        "+": Sentence("{name} has {a} {item}. {P} gets {b} more {item} from {friend}.",
                      "{name} has {a} + {b} = {r} {item}."),
        "-": Sentence("{name} has {a} {item}. {P} gives {b} {item} to {friend}.",
                      "{name} has {a} - {b} = {r} {item} left."),
        "*": Sentence("{name} buys {a} boxes of {item} with {b} {item} in each box.",
                      "{name} has {a} * {b} = {r} {item}."),
        "/": Sentence("{name} has {a} {item}. {P} splits them into {b} equal piles and keeps one pile.",
                      "{name} keeps {a} / {b} = {r} {item}."),
    },
    follow={
        "+": Sentence("Then {p} finds {b} more {item}.", "{P} now has {x} + {b} = {r} {item}."),
        "-": Sentence("After that, {p} loses {b} {item}.", "{P} now has {x} - {b} = {r} {item}."),
        "*": Sentence("Next, {p} trades with {friend} and ends up with {b} times as many {item}.",
                      "{P} now has {x} * {b} = {r} {item}."),
        "/": Sentence("Then {p} splits {poss} {item} into {b} equal piles and keeps one pile.",
                      "{P} keeps {x} / {b} = {r} {item}."),
    },
    vocabulary={"item": ("apples", "marbles", "stickers", "books", "pencils", "seashells", "cards", "coins")},
)

MONEY = Theme(
    name="money",
    ask="How many dollars does {name} have now?",
    start={
        "+": Sentence("{name} has ${a}. {P} earns ${b} {job}.", "{name} has {a} + {b} = {r} dollars."),
        "-": Sentence("{name} has ${a}. {P} spends ${b} on {thing}.", "{name} has {a} - {b} = {r} dollars left."),
        "*": Sentence("{name} starts with no money and sells {a} {goods} for ${b} each.",
                      "{name} earns {a} * {b} = {r} dollars."),
        "/": Sentence("A prize of ${a} is shared equally by {b} winners, and {name} is one of them.",
                      "{name} gets {a} / {b} = {r} dollars."),
    },
    follow={
        "+": Sentence("Then {p} earns ${b} {job}.", "{P} now has {x} + {b} = {r} dollars."),
        "-": Sentence("Then {p} spends ${b} on {thing}.", "{P} now has {x} - {b} = {r} dollars."),
        "*": Sentence("After a year of saving, {poss} money has grown to {b} times as much.",
                      "{P} now has {x} * {b} = {r} dollars."),
        "/": Sentence("Then {p} puts {poss} money equally into {b} envelopes and keeps only one envelope.",
                      "{P} keeps {x} / {b} = {r} dollars."),
    },
    vocabulary={
        "job": ("walking dogs", "mowing lawns", "babysitting", "selling lemonade", "washing cars"),
        "thing": ("a book", "a toy", "snacks", "a movie ticket", "a new hat"),
        "goods": ("cupcakes", "bracelets", "drawings", "plants", "candles"),
    },
    per_step=("job", "thing"),
)

TRAVEL = Theme(
    name="travel",
    ask="How many kilometers is {name} from home now?",
    start={
        "+": Sentence("{name} drives {a} km away from home in the morning and {b} km farther in the afternoon.",
                      "{name} is {a} + {b} = {r} km from home."),
        "-": Sentence("{name} rides {poss} {vehicle} {a} km away from home, then {b} km back toward home.",
                      "{name} is {a} - {b} = {r} km from home."),
        "*": Sentence("{name} rides {poss} {vehicle} away from home at {a} km per hour for {b} hours.",
                      "{name} travels {a} * {b} = {r} km."),
        "/": Sentence("{name} plans a {a} km trip away from home in {b} equal legs and does only the first leg.",
                      "One leg is {a} / {b} = {r} km."),
    },
    follow={
        "+": Sentence("Then {p} travels {b} km farther from home.", "{P} is {x} + {b} = {r} km from home."),
        "-": Sentence("Then {p} turns around and travels {b} km back toward home.",
                      "{P} is {x} - {b} = {r} km from home."),
        "*": Sentence("Then {p} keeps going away from home until {p} is {b} times as far from home.",
                      "{P} is {x} * {b} = {r} km from home."),
        "/": Sentence("Then {p} turns back and stops when {poss} distance from home is 1/{b} of what it was.",
                      "{P} is {x} / {b} = {r} km from home."),
    },
    vocabulary={"vehicle": ("bike", "scooter", "car", "motorbike")},
)

BAKING = Theme(
    name="baking",
    ask="How many {food} does {name} have now?",
    start={
        "+": Sentence("{name} bakes {a} {food} on Saturday and {b} {food} on Sunday.",
                      "{name} bakes {a} + {b} = {r} {food}."),
        "-": Sentence("{name} bakes {a} {food} and sells {b} of them.", "{name} has {a} - {b} = {r} {food} left."),
        "*": Sentence("{name} bakes {a} trays of {food} with {b} {food} on each tray.",
                      "{name} bakes {a} * {b} = {r} {food}."),
        "/": Sentence("{name} bakes {a} {food}, packs them equally into {b} boxes and keeps one box.",
                      "One box holds {a} / {b} = {r} {food}."),
    },
    follow={
        "+": Sentence("{friend} brings {obj} {b} more {food}.", "{name} has {x} + {b} = {r} {food}."),
        "-": Sentence("The family eats {b} of {poss} {food}.", "{name} has {x} - {b} = {r} {food} left."),
        "*": Sentence("For a party, {p} bakes more until {p} has {b} times as many {food}.",
                      "{name} has {x} * {b} = {r} {food}."),
        "/": Sentence("{P} packs {poss} {food} equally into {b} boxes and keeps one box.",
                      "One box holds {x} / {b} = {r} {food}."),
    },
    vocabulary={"food": ("cookies", "muffins", "cupcakes", "bread rolls", "pies")},
)

THEMES: tuple[Theme, ...] = (COLLECTION, MONEY, TRAVEL, BAKING)
