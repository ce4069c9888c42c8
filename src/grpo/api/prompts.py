"""Prompt lengths under the Python API, measured as the rollout renders them (the row's own system turn, the
tools' schemas), and said in a TRL user's words.

TRL never cuts or refuses a prompt; grpo needs a bound (``data.max_prompt_length``: vLLM's model length, the
rollout's check). Under the API it is the model's context less ``max_completion_length`` unless the user sets
``grpo_overrides['data.max_prompt_length']``. Nothing tokenizes the whole dataset at start: every sampled
prompt is measured exactly when its step renders it (``PromptTooLong``, raised before that step's update, so
no finished step is lost), and ``check_longest`` measures only the few rows longest in characters up front.
"""

from __future__ import annotations

from typing import Any, Sequence

from grpo.data import DataError, Example, PromptTooLong, build_prompt_messages

LIMIT_KEY = "data.max_prompt_length"
CHECKED_UP_FRONT = 16  # rows measured exactly in GRPOTrainer.__init__, the longest in characters
NO_CONTEXT = 1 << 20  # a model config without max_position_embeddings: no bound of grpo's own


def context_length(model_config: Any) -> int | None:
    return getattr(model_config, "max_position_embeddings", None)


def prompt_limit(context: int | None, max_completion_length: int) -> int:
    """The longest prompt a completion of ``max_completion_length`` still fits after in the model's context."""
    if context is None:
        return NO_CONTEXT
    return max(1, context - max_completion_length)


def rendered_length(tokenizer: Any, example: Example, schemas: list[dict]) -> int:
    """Tokens of ``example``'s prompt exactly as a rollout renders it: text as written, chat messages with the
    row's system turn and, with tools, their schemas (``grpo.multiturn.driver``)."""
    if example.plain_text:
        text = example.question
    else:
        text = tokenizer.apply_chat_template(build_prompt_messages(example, None), tools=schemas or None,
                                             tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _characters(example: Example) -> int:
    return sum(len(str(m.get("content", ""))) for m in example.messages) + len(example.system or "")


def check_longest(tokenizer: Any, sets: dict[str, Sequence[Example]], schemas: list[dict], limit: int,
                  explain) -> None:
    """Measure the ``CHECKED_UP_FRONT`` rows of each set with the most characters; one over ``limit`` is a
    DataError in ``explain``'s words (the rest are measured when sampled)."""
    for examples in sets.values():
        longest = sorted(examples, key=_characters, reverse=True)[:CHECKED_UP_FRONT]
        for example in longest:
            length = rendered_length(tokenizer, example, schemas)
            if length > limit:
                raise explain(PromptTooLong(example.source, length, limit,
                                            "prompt with its tools" if schemas else "prompt"))


def explainer(overrides: dict, context: int | None, max_completion_length: int):
    """``PromptTooLong`` -> a DataError saying what to shorten, or which field to set, in the API's terms."""
    def explain(err: PromptTooLong) -> DataError:
        what = f"{err.source}: the {err.what} (rendered with its system message) is {err.length} tokens"
        if LIMIT_KEY in overrides:
            return DataError(f"{what}, over grpo_overrides[{LIMIT_KEY!r}]={err.limit}: shorten the prompt or raise "
                             "that value")
        return DataError(f"{what}: with max_completion_length {max_completion_length} it does not fit the model's "
                         f"context of {context} tokens (config.max_position_embeddings): shorten the prompt (its "
                         "system message, the tools' docstrings), lower max_completion_length, or set "
                         f"grpo_overrides={{{LIMIT_KEY!r}: {err.length}}} to sample past the context")
    return explain
