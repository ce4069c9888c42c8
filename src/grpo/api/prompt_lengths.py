"""Prompt lengths under the Python API, measured as the rollout renders them (the row's own system turn, the
tools' schemas), and said in a TRL user's words.

TRL never cuts or refuses a prompt, and with grpo's own engines neither does the API (``data.max_prompt_length``
is ``NO_BOUND``). vLLM takes no more than the model's context (TRL's vLLM refuses the rest too), so with vLLM
the bound is that context less ``max_completion_length``; ``grpo_overrides['data.max_prompt_length']`` sets
another. Nothing tokenizes the whole dataset at start: every sampled prompt is measured exactly when its step
renders it (``PromptTooLong``, raised before that step's update, so no finished step is lost), and
``check_longest`` measures only the few rows longest in characters up front.
"""

from __future__ import annotations

from typing import Any, Sequence

from grpo.data import DataError, Example, PromptTooLong, build_prompt_messages

LIMIT_KEY = "data.max_prompt_length"
CHECKED_UP_FRONT = 16  # rows measured exactly in GRPOTrainer.__init__, the longest in characters
NO_BOUND = 1 << 30  # tokens: no prompt is refused


def context_length(model_config: Any) -> int | None:
    return getattr(model_config, "max_position_embeddings", None)


def prompt_limit(context: int | None, max_completion_length: int, fixed_context: bool) -> int:
    """``NO_BOUND``, or for an engine whose context is fixed when built (``EngineTraits.fixed_context``: vLLM) the
    longest prompt a completion of ``max_completion_length`` still fits after in the model's context."""
    if not fixed_context or context is None:
        return NO_BOUND
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
    DataError in ``explain``'s words (the rest are measured when sampled). Nothing to do without a bound."""
    if limit >= NO_BOUND:
        return
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
                         f"context of {context} tokens (config.max_position_embeddings), all vLLM samples in: "
                         "shorten the prompt (its system message, the tools' docstrings) or lower "
                         "max_completion_length")
    return explain
