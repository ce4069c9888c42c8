"""TRL's datasets as grpo's ``Example`` records: a ``prompt`` column (text, or chat messages) and any other
columns, which reward functions get verbatim, as TRL passes them.

A chat prompt's leading system turn stays the row's own (``Example.system``; the run adds none), and a text
prompt is used as written, without the chat template (``Example.plain_text``), as TRL renders them.
"""

from __future__ import annotations

import copy

import itertools
from typing import Any, Sequence

from grpo.data import DataError, Example
from grpo.data.gold_formats import normalise_answer
from grpo.data.reasoning_gym import dataset_examples, is_reasoning_gym_dataset
from grpo.data.verifiers_env import GIVEN, given_environment, is_verifiers_environment

NOT_PASSED = ("prompt", "completion", "completion_ids")  # the columns TRL keeps from reward functions


def dataset_rows(dataset: Any, name: str, limit: int | None = None) -> list[dict]:
    """The rows of a ``datasets.Dataset``, an ``IterableDataset`` (its first ``limit`` rows) or a list of dicts."""
    if isinstance(dataset, dict):
        raise TypeError(f"{name} is a dict: a dict of named datasets is for eval_dataset only")
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        rows = [dataset[i] for i in range(len(dataset))]
    elif hasattr(dataset, "__iter__"):
        if limit is None:
            raise ValueError(f"{name} is an IterableDataset: set max_steps > 0, which says how many rows to take")
        rows = list(itertools.islice(iter(dataset), limit))
    else:
        raise TypeError(f"{name} must be a datasets.Dataset, IterableDataset or a list of dicts, got "
                        f"{type(dataset).__name__}")
    return rows


def verifiers_arguments(train_dataset: Any, reward_funcs: Any, args: Any) -> tuple[Any, Any]:
    """(train_dataset, args) for a verifiers environment given as ``train_dataset``: none, and ``args`` (a copy)
    whose ``grpo_overrides`` name it as ``data.train`` (its taskset's prompts, its harness's episodes), with no
    rewards but its tasks' own unless ``reward_funcs`` are given. Anything else comes back as it was."""
    if not is_verifiers_environment(train_dataset):
        return train_dataset, args
    overrides = {"data.train": given_environment(train_dataset, GIVEN)}
    if reward_funcs is None:
        overrides["rewards"] = []
    args = copy.copy(args)
    args.grpo_overrides = {**args.grpo_overrides, **overrides}
    return None, args


def to_examples(dataset: Any, name: str, *, pass_columns: bool = True, limit: int | None = None) -> Sequence[Example]:
    """One ``Example`` per row. ``pass_columns`` False (TRL's remove_unused_columns=True): rewards get no
    dataset columns. ``answer``, when a column, also feeds grpo's accuracy metric. Errors name the row.
    A ``datasets.Dataset`` is read lazily (``LazyExamples``): its columns are checked now, a row when it is read.
    A reasoning-gym dataset object gives its items, scored by the ``reasoning_gym`` task (``grpo.data.reasoning_gym``)."""
    if is_reasoning_gym_dataset(dataset):
        return dataset_examples(dataset, name, limit)
    lazy = not isinstance(dataset, dict) and hasattr(dataset, "column_names") and hasattr(dataset, "__len__")
    if lazy and hasattr(dataset, "__getitem__"):
        return LazyExamples(dataset, name, pass_columns)
    rows = dataset_rows(dataset, name, limit)
    if not rows:
        raise ValueError(f"{name} has no rows")
    chat = isinstance(rows[0].get("prompt"), list) if isinstance(rows[0], dict) else None
    return [to_example(row, f"{name}[{index}]", chat, pass_columns) for index, row in enumerate(rows)]


class LazyExamples(Sequence):
    """A ``datasets.Dataset``'s rows as ``Example`` records, each made when first read (as TRL reads a row when it
    samples it), so that nothing at start grows with the dataset; its columns are checked at once."""

    def __init__(self, dataset: Any, name: str, pass_columns: bool):
        if len(dataset) == 0:
            raise ValueError(f"{name} has no rows")
        if "prompt" not in dataset.column_names:
            raise DataError(f"{name}[0]: no 'prompt' column (its columns: {sorted(dataset.column_names)}); TRL's GRPO "
                            "datasets carry the prompt as text or as chat messages in 'prompt'")
        self.dataset, self.name, self.pass_columns = dataset, name, pass_columns
        self.made: dict[int, Example] = {}
        self.chat = isinstance(dataset[0]["prompt"], list)
        self.made[0] = to_example(dataset[0], f"{name}[0]", self.chat, pass_columns)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # negative indices; IndexError past the end
        if index not in self.made:
            self.made[index] = to_example(self.dataset[index], f"{self.name}[{index}]", self.chat, self.pass_columns)
        return self.made[index]


def to_example(row: dict, source: str, chat: bool | None, pass_columns: bool) -> Example:
    """One row as an ``Example``; ``chat``: whether the dataset's prompts are chat messages (its first row's)."""
    if not isinstance(row, dict):
        raise TypeError(f"{source} is a {type(row).__name__}, not a dict of columns")
    if "prompt" not in row:
        raise DataError(f"{source}: no 'prompt' column (its columns: {sorted(row)}); TRL's GRPO datasets "
                        "carry the prompt as text or as chat messages in 'prompt'")
    prompt = row["prompt"]
    is_chat = isinstance(prompt, list)
    if not is_chat and not isinstance(prompt, str):
        raise DataError(f"{source}: 'prompt' must be text or a list of chat messages, got {type(prompt).__name__}")
    if chat is not None and is_chat != chat:
        raise DataError(f"{source}: 'prompt' is {'chat messages' if is_chat else 'text'} but the first row's is "
                        f"{'chat messages' if chat else 'text'}; one dataset holds one kind")
    columns = {k: v for k, v in row.items() if k not in NOT_PASSED} if pass_columns else {}
    gold = row.get("answer")
    answer = normalise_answer(str(gold)) if gold is not None else None
    raw = None if gold is None else str(gold)
    if not is_chat:
        return Example([{"role": "user", "content": prompt}], answer, raw, source, row=columns, plain_text=True)
    system = None
    if prompt and isinstance(prompt[0], dict) and prompt[0].get("role") == "system":
        system, prompt = prompt[0].get("content"), prompt[1:]
        if not isinstance(system, str):
            raise DataError(f"{source}: the system message's content must be text, got {type(system).__name__}")
    messages = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in prompt]
    return Example(messages, answer, raw, source, system=system, row=columns)
