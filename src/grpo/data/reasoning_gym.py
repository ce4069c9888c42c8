"""reasoning-gym's procedural datasets (``pip install 'grpo[envs]'``) as grpo ``Example`` records.

Source string (``data.train``, ``data.eval``), after the ``reasoning_gym:`` prefix::

    NAME[*WEIGHT][,key=value...][+NAME[*WEIGHT][,key=value...]...]

- one NAME: ``reasoning_gym.create_dataset(NAME, size=, seed=, **kwargs)``, e.g.
  ``reasoning_gym:chain_sum,size=500,seed=1,min_terms=2,max_terms=2,max_digits=1``;
- several joined by ``+`` (a ``+`` followed by a name; one in a value stays): reasoning-gym's ``CompositeDataset``, each item drawn from one of them with
  probability proportional to its ``*WEIGHT`` (default 1), e.g. ``reasoning_gym:chain_sum*3+basic_arithmetic``.
``size`` (default 500) and ``seed`` (default 0, so that every rank generates the same problems) belong to
the whole source and may stand in any part; every other key belongs to the dataset it follows and is passed
to that dataset's config. Values are read as int, float, ``true``/``false``, ``none``, else text; a
tuple-valued option (``operators``) is written with ``|``: ``operators=+|-``. As with ``synthetic:``,
the split is ignored: give eval a different seed.

An item's gold (``Example.answer``) is the whole entry reasoning-gym scores against, written as a Python
literal (``gold_text``; ``parse_gold`` reads it back, tuples intact): its dataset's ``score_answer`` needs
the entry's metadata, and the gold string is what grpo hands to a task's scorer and to rewards (column
``answer``). ``Example.answer_raw`` is the plain answer.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from grpo.data.example import DataError, Example

INSTALL_HINT = "reasoning-gym is not installed: pip install 'grpo[envs]' (or pip install reasoning-gym==0.1.25)"
PREFIX = "reasoning_gym"
SOURCE_KEYS = ("size", "seed")  # the whole source's keys; every other key is a dataset's
DEFAULT_SIZE, DEFAULT_SEED = 500, 0
# A "+" that starts the next dataset's name, so that a value may hold one: operators=+|-
PART_SEPARATOR = re.compile(r"\+(?=\s*[A-Za-z_])")


def require_reasoning_gym():
    """The ``reasoning_gym`` module, or a DataError naming the extra that installs it."""
    try:
        import reasoning_gym  # optional extra (grpo[envs])
    except ImportError as error:
        if error.name not in ("reasoning_gym", None):  # installed, but something it needs is broken
            raise
        raise DataError(INSTALL_HINT) from None
    return reasoning_gym


@dataclass(frozen=True)
class DatasetPart:
    """One dataset of a source: its reasoning-gym name, its weight in a composite and its config options."""

    name: str
    weight: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RgSpec:
    """A parsed ``reasoning_gym:`` source: its datasets, how many items and from which seed."""

    parts: tuple[DatasetPart, ...]
    size: int = DEFAULT_SIZE
    seed: int = DEFAULT_SEED


def parse_value(text: str) -> Any:
    """A spec value as the Python value a reasoning-gym config takes (module docstring)."""
    if "|" in text:
        return tuple(parse_value(item) for item in text.split("|"))
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str, option_text: str) -> RgSpec:
    """``option_text`` (the spec after ``reasoning_gym:``) as an ``RgSpec``; a DataError quoting ``spec`` says
    what is malformed. Dataset names are not checked here (``build_dataset`` does, listing the known ones)."""
    parts: list[DatasetPart] = []
    source: dict[str, int] = {}
    for part_text in PART_SEPARATOR.split(option_text):
        head, *items = [item.strip() for item in part_text.split(",")]
        name, star, weight_text = head.partition("*")
        name = name.strip()
        if not name or "=" in name:
            raise DataError(f"data source {spec!r}: each dataset part starts with a reasoning-gym dataset name, "
                            f"got {part_text.strip()!r} (form: {PREFIX}:NAME[*WEIGHT][,key=value...][+NAME...])")
        weight = _number(spec, f"{name}'s weight", weight_text, float) if star else 1.0
        if weight <= 0:
            raise DataError(f"data source {spec!r}: {name}'s weight must be positive, got {weight_text!r}")
        options: dict[str, Any] = {}
        for item in items:
            key, equals, value = (piece.strip() for piece in item.partition("="))
            if not equals or not key or not value:
                raise DataError(f"data source {spec!r}: expected key=value, got {item!r}")
            target = source if key in SOURCE_KEYS else options
            if key in target:
                raise DataError(f"data source {spec!r}: key {key!r} given twice")
            target[key] = _number(spec, key, value, int) if key in SOURCE_KEYS else parse_value(value)
        parts.append(DatasetPart(name, weight, options))
    if source.get("size", DEFAULT_SIZE) < 1:
        raise DataError(f"data source {spec!r}: size must be at least 1, got {source['size']}")
    return RgSpec(tuple(parts), **source)


def _number(spec: str, what: str, text: str, kind: type) -> Any:
    try:
        return kind(text.strip())
    except ValueError:
        raise DataError(f"data source {spec!r}: {what} must be {'an integer' if kind is int else 'a number'}, "
                        f"got {text.strip()!r}") from None


def dataset_names() -> list[str]:
    """Every dataset name the installed reasoning-gym registers."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS  # optional extra (grpo[envs])

    return sorted(DATASETS)


def build_dataset(parsed: RgSpec, spec: str):
    """The reasoning-gym dataset object ``parsed`` describes (a ``CompositeDataset`` for several parts). An
    unknown name lists the known ones; an option its config refuses is a DataError naming the dataset."""
    rg = require_reasoning_gym()
    from reasoning_gym.factory import DATASETS  # optional extra (grpo[envs])

    for part in parsed.parts:
        if part.name not in DATASETS:
            raise DataError(f"data source {spec!r}: unknown reasoning-gym dataset {part.name!r}; known: "
                            f"{sorted(DATASETS)}")
        allowed = sorted(f.name for f in dataclasses.fields(DATASETS[part.name][1]) if f.name not in SOURCE_KEYS)
        unknown = sorted(set(part.options) - set(allowed))
        if unknown:
            raise DataError(f"data source {spec!r}: {part.name} has no option(s) {unknown}; its options: {allowed}, "
                            f"and the source's {list(SOURCE_KEYS)}")
    try:
        if len(parsed.parts) == 1:
            part = parsed.parts[0]
            return rg.create_dataset(part.name, size=parsed.size, seed=parsed.seed, **part.options)
        # reasoning-gym: the optional extra (grpo[envs])
        from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

        specs = [DatasetSpec(name=p.name, weight=p.weight, config=dict(p.options)) for p in parsed.parts]
        return CompositeDataset(CompositeConfig(size=parsed.size, seed=parsed.seed, datasets=specs))
    except (TypeError, ValueError, AssertionError) as error:  # the configs' own checks are asserts
        raise DataError(f"data source {spec!r}: reasoning-gym refused the options: "
                        f"{str(error) or type(error).__name__}") from None


def gold_text(entry: dict[str, Any]) -> str:
    """An entry's gold as stored in ``Example.answer``: ``{"answer", "metadata"}`` as a Python literal."""
    return repr({"answer": entry["answer"], "metadata": entry.get("metadata", {})})


def parse_gold(gold: Any) -> dict[str, Any]:
    """The entry ``gold_text`` wrote (what ``score_answer`` takes); a ValueError when ``gold`` is not one."""
    if isinstance(gold, dict):
        return gold
    try:
        entry = ast.literal_eval(str(gold))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        entry = None
    if not isinstance(entry, dict) or "answer" not in entry or "source_dataset" not in entry.get("metadata", {}):
        raise ValueError(f"gold {str(gold)[:80]!r} is not a reasoning-gym entry (data source {PREFIX}:...)")
    return entry


def dataset_examples(dataset: Any, source: str, limit: int | None = None) -> list[Example]:
    """The first ``limit`` (else all) items of a reasoning-gym dataset object as Examples; ``source`` names
    them ("<source>#<index>"). An item whose metadata is no Python literal is a DataError naming it."""
    count = len(dataset) if limit is None else min(len(dataset), limit)
    examples = []
    for index in range(count):
        entry = dataset[index]
        where = f"{source}#{index}"
        gold = gold_text(entry)
        try:
            same = ast.literal_eval(gold) == {"answer": entry["answer"], "metadata": entry.get("metadata", {})}
        except (ValueError, SyntaxError):
            same = False
        if not same:
            raise DataError(f"{where}: the entry's metadata cannot be stored as the gold (not plain Python values)")
        examples.append(Example([{"role": "user", "content": entry["question"]}], gold, str(entry["answer"]), where))
    return examples


def load_reasoning_gym(spec: str, option_text: str, limit: int | None = None) -> list[Example]:
    """The Examples of a ``reasoning_gym:`` source string (module docstring)."""
    parsed = parse_spec(spec, option_text)
    return dataset_examples(build_dataset(parsed, spec), spec, limit)


def is_reasoning_gym_dataset(value: Any) -> bool:
    """Whether ``value`` is a reasoning-gym dataset object (checked without importing reasoning-gym)."""
    return any(cls.__module__.startswith("reasoning_gym.") and cls.__name__ == "ProceduralDataset"
               for cls in type(value).__mro__)
