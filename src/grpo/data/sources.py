"""Data source strings (the config's `data.train` / `data.eval`) -> a list of Examples.

Forms, looked up by the prefix before the first ":" in `SOURCE_KINDS`:
- ``synthetic:seed=123,n=500[,difficulty=mixed][,steps=2][,max_digits=2]``: generated problems
  (`grpo.data.synthetic`). Use different seeds for train and eval: the split is not mixed in.
- ``arithmetic-tools:seed=123,n=500[,size=mix]``: one-step problems with large numbers (a calculator's
  job), small ones or both (`grpo.data.arithmetic_tools`, size large|small|mix).
- ``kk:seed=1,n=500[,people=2-8]``: generated Knights-and-Knaves logic puzzles with exactly one solution,
  2 to 8 people each by default (``people=LO-HI`` or one number); ``kk:path=people3_num100.jsonl``: a public
  K&K benchmark file, quiz text verbatim (`grpo.data.knights_knaves`; the reward is ``kk_logic``).
- ``reasoning_gym:chain_sum,size=500,seed=1[,<dataset options>][+NAME[*WEIGHT]...]``: reasoning-gym's
  procedural datasets, one or a weighted mix (`grpo.data.reasoning_gym`, which parses its own options).
- ``verifiers:TASKSET_ID[,env=ENV_ID][,harness=HARNESS_ID][,limit=N]``: a verifiers environment's taskset, one
  prompt per task; its harness plays the episodes (`grpo.data.verifiers_env`, `grpo.multiturn.verifiers_rollout`).
- ``prompts:path=chat.jsonl[,question_column=src][,answer_column=answer][,answer_format=gsm8k]
  [,tgt_column=tgt]``: any prompt file (`grpo.data.prompt_datasets.load_prompts`).
- anything else: GSM8K from a file, a folder (the split's file inside) or a hub id such as
  "openai/gsm8k" (`grpo.data.gsm8k.load_gsm8k`).
Values cannot contain "," (the separator); paths with commas must use the plain GSM8K form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.data.arithmetic_tools import generate_tool_problems
from grpo.data.example import DataError, Example
from grpo.data.gold_kinds import KK_SOLUTION, MATH, NO_GOLD, REASONING_GYM_ENTRY
from grpo.data.gsm8k import load_gsm8k
from grpo.data.knights_knaves.examples import file_examples, generated_examples
from grpo.data.locations import check_limit
from grpo.data.prompt_datasets import load_prompts
from grpo.data.reasoning_gym import load_reasoning_gym
from grpo.data.synthetic import generate_problems
from grpo.data.verifiers_env import load_verifiers


@dataclass(frozen=True)
class SourceKind:
    """One prefixed source form: its option keys and the loader given the parsed options."""

    # every allowed key -> the type its text is converted to (int, str), or a converter function that
    # raises ValueError saying what it accepts
    keys: dict[str, type | Callable[[str], Any]]
    required: tuple[str, ...]
    load: Callable[[dict[str, Any], str, int | None], list[Example]]
    # a kind whose options are no flat key=value list parses them itself: (spec, option text) -> options
    parse: Callable[[str, str], dict[str, Any]] | None = None
    # the gold its examples carry (grpo.data.gold_kinds), from its option text; None: not known before reading
    gold: Callable[[str], str | None] = lambda option_text: None


def _load_synthetic(options: dict[str, Any], split: str, limit: int | None) -> list[Example]:
    # The split is ignored on purpose (see module docstring); `limit` can cut generation short
    # because problem i does not depend on the problems after it.
    n = options.pop("n")
    return generate_problems(min(n, limit) if limit is not None else n, **options)


def _load_tool_problems(options: dict[str, Any], split: str, limit: int | None) -> list[Example]:
    n = options.pop("n")  # as synthetic: the split is ignored, problem i does not depend on later ones
    return generate_tool_problems(min(n, limit) if limit is not None else n, **options)


def _load_kk(options: dict[str, Any], split: str, limit: int | None) -> list[Example]:
    if "path" in options:  # one file: the split is ignored, as for any single file
        if len(options) > 1:
            raise DataError(f"data source kk: path= reads a file and takes no other key, got {sorted(options)}")
        return file_examples(options["path"], limit=limit)
    missing = [key for key in ("seed", "n") if key not in options]
    if missing:
        raise DataError(f"data source kk: missing key(s) {missing}: give seed=S,n=N[,people=LO-HI] or path=FILE")
    n = options.pop("n")  # as synthetic: the split is ignored, puzzle i does not depend on later ones
    return generated_examples(min(n, limit) if limit is not None else n, **options)


def people_range(text: str) -> tuple[int, int]:
    """``"2-8"`` -> (2, 8), ``"5"`` -> (5, 5): an inclusive range of positive counts, low end first."""
    low, dash, high = text.partition("-")
    try:
        bounds = (int(low), int(high)) if dash else (int(text), int(text))
    except ValueError:
        raise ValueError(f"expected a count (5) or a range LO-HI (2-8), got {text!r}") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise ValueError(f"expected positive counts with LO <= HI, got {text!r}")
    return bounds


def _load_reasoning_gym(options: dict[str, Any], split: str, limit: int | None) -> list[Example]:
    return load_reasoning_gym(options["spec"], options["text"], limit)  # as synthetic: the split is ignored


def _load_verifiers(options: dict[str, Any], split: str, limit: int | None) -> list[Example]:
    return load_verifiers(options["spec"], options["text"], limit)  # a taskset has no splits


def _load_prompt_file(options: dict[str, Any], split: str, limit: int | None) -> list[Example]:
    path = options.pop("path")
    return load_prompts(path, split=split, limit=limit, **options)


SOURCE_KINDS: dict[str, SourceKind] = {
    "synthetic": SourceKind(
        keys={"seed": int, "n": int, "difficulty": str, "steps": int, "max_digits": int},
        required=("seed", "n"),
        load=_load_synthetic,
        gold=lambda options: MATH,
    ),
    "arithmetic-tools": SourceKind(
        keys={"seed": int, "n": int, "size": str},
        required=("seed", "n"),
        load=_load_tool_problems,
        gold=lambda options: MATH,
    ),
    "kk": SourceKind(
        keys={"seed": int, "n": int, "people": people_range, "path": str},
        required=(),  # seed and n, or path alone: checked by the loader
        load=_load_kk,
        gold=lambda options: KK_SOLUTION,
    ),
    "prompts": SourceKind(
        keys={"path": str, "question_column": str, "answer_column": str, "answer_format": str, "tgt_column": str},
        required=("path",),
        load=_load_prompt_file,
        gold=lambda options: MATH if "answer_format=gsm8k" in options.split(",") else None,  # plain: any text
    ),
    "reasoning_gym": SourceKind(
        keys={}, required=(), load=_load_reasoning_gym, parse=lambda spec, text: {"spec": spec, "text": text},
        gold=lambda options: REASONING_GYM_ENTRY,
    ),
    "verifiers": SourceKind(
        keys={}, required=(), load=_load_verifiers, parse=lambda spec, text: {"spec": spec, "text": text},
        gold=lambda options: NO_GOLD,
    ),
}


def load_dataset_source(spec: str, split: str = "train", limit: int | None = None) -> list[Example]:
    """Load the Examples a data source string names (forms in the module docstring).

    split: the split read from a folder or hub id ("train", "test"); limit: keep the first
    `limit` examples. Raises DataError for a malformed spec (unknown or missing keys, listing
    the allowed ones) and for bad data (naming file and line).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"data source must be a non-empty string, got {spec!r}")
    check_limit(limit)
    kind_name, separator, option_text = spec.partition(":")
    kind = SOURCE_KINDS.get(kind_name) if separator else None
    if kind is None:
        return load_gsm8k(spec, split=split, limit=limit)
    options = kind.parse(spec, option_text) if kind.parse is not None else parse_options(spec, option_text, kind)
    return kind.load(options, split, limit)


# A data.train the Python API fills from a dataset object ("python:train_dataset (64 rows)"): no source to read.
PYTHON_OBJECT = "python:"


def source_gold(spec: str) -> str | None:
    """The gold kind (``grpo.data.gold_kinds``) the examples of source ``spec`` carry, read from the string alone
    (nothing is loaded): a prefixed kind's declaration; GSM8K's reader (files, folders, hub ids) gives ``math``;
    None where it cannot be known before the data is read (a ``prompts:`` file of plain answers, a Python
    dataset object)."""
    if spec.startswith(PYTHON_OBJECT):
        return None
    kind_name, separator, option_text = spec.partition(":")
    kind = SOURCE_KINDS.get(kind_name) if separator else None
    return MATH if kind is None else kind.gold(option_text)


def parse_options(spec: str, option_text: str, kind: SourceKind) -> dict[str, Any]:
    """Parse "key=value,key=value" for one source kind, converting values to the kind's types."""
    types = kind.keys
    allowed = sorted(types)
    options: dict[str, Any] = {}
    for item in option_text.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key or not value:
            raise DataError(f"data source {spec!r}: expected key=value, got {item!r}; allowed keys: {allowed}")
        if key not in types:
            raise DataError(f"data source {spec!r}: unknown key {key!r}; allowed keys: {allowed}")
        if key in options:
            raise DataError(f"data source {spec!r}: key {key!r} given twice")
        options[key] = _convert(spec, key, value, types[key])
    missing = [key for key in kind.required if key not in options]
    if missing:
        raise DataError(f"data source {spec!r}: missing key(s) {missing}; allowed keys: {allowed}")
    return options


def _convert(spec: str, key: str, value: str, kind: type) -> Any:
    if kind is int:
        try:
            return int(value)
        except ValueError:
            raise DataError(f"data source {spec!r}: {key} must be an integer, got {value!r}") from None
    if kind is str:
        return value
    try:
        return kind(value)
    except ValueError as error:
        raise DataError(f"data source {spec!r}: {key}: {error}") from None

