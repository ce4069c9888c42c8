"""Built-in reward factories: each takes a tag style and returns a TRL-signature reward function.

Two are this project's own (``answer_correct``, ``format_think_answer``, default style ``think``);
five reproduce, value for value, the well-known Unsloth / willccbb GSM8K GRPO script
(``xmlcount``, ``soft_format``, ``strict_format``, ``int_answer``, ``correctness``, default style
``reasoning``, the tag names they were written for). Their quirks are kept on purpose so runs can be
compared with TRL runs of that script; each quirk is noted where it is kept.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from grpo.data.tags import TagStyle
from grpo.rewards.answers import (
    answers_equal,
    extract_answer,
    final_text,
    gold_answer,
    is_well_formatted,
    style_of,
)
from grpo.rewards.signature import RewardCallable

Completion = str | list[dict[str, Any]]


def _require_answers(name: str, answer: Sequence[Any] | None, columns: dict[str, Any]) -> Sequence[Any]:
    if answer is None:
        raise ValueError(
            f"reward {name!r} needs the dataset column 'answer'; got columns {sorted(columns)}"
        )
    return answer


# --- this project's rewards -------------------------------------------------------------------------


def make_answer_correct(tag_style: TagStyle | str = "think") -> RewardCallable:
    """``answer_correct``: +1.0 if the ``<answer>`` content equals the gold answer, else -1.0.

    Gold comes from the column ``answer`` (a bare answer or a GSM8K solution ending ``#### x``).
    Equality is ``answers_equal`` (numeric for plain numbers, math-verify otherwise). A completion
    without an answer tag scores -1.0.
    """
    style = style_of(tag_style)

    def answer_correct(
        prompts: Sequence[Any],
        completions: Sequence[Completion],
        answer: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        golds = _require_answers("answer_correct", answer, kwargs)
        return [
            1.0 if answers_equal(extract_answer(final_text(c), style), gold_answer(str(g))) else -1.0
            for c, g in zip(completions, golds, strict=True)
        ]

    return answer_correct


def make_format_think_answer(tag_style: TagStyle | str = "think") -> RewardCallable:
    """``format_think_answer``: +1.25 when the completion is ``<r>...</r>`` then ``<answer>...</answer>``
    with only whitespace around and between (``is_well_formatted``), else -1.0.

    The tag ``r`` is the style's reasoning tag (``think`` or ``reasoning``).
    """
    style = style_of(tag_style)

    def format_think_answer(
        prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any
    ) -> list[float | None]:
        return [1.25 if is_well_formatted(final_text(c), style) else -1.0 for c in completions]

    return format_think_answer


# --- the Unsloth / willccbb GSM8K five --------------------------------------------------------------


def extract_xml_answer(text: str, tag_style: TagStyle | str = "reasoning") -> str:
    """The script's answer extraction: text after the last ``<answer>``, before the next ``</answer>``,
    stripped. Quirk kept: with no tag at all it returns the whole (stripped) completion."""
    tag = style_of(tag_style).answer_tag
    return text.split(f"<{tag}>")[-1].split(f"</{tag}>")[0].strip()


def count_xml(text: str, tag_style: TagStyle | str = "reasoning") -> float:
    """The script's ``count_xml``: 0.125 per well-placed tag, minus 0.001 per character after the answer.

    ``"<r>\\n"``, ``"\\n</r>\\n"``, ``"\\n<answer>\\n"``, ``"\\n</answer>"`` must each occur exactly once.
    Quirk kept: the trailing-text penalty for ``"\\n<answer>\\n"`` measures the text after
    ``"\\n</answer>\\n"`` (the whole text when that is absent, so a missing final newline costs
    0.001 per character of the completion).
    """
    style = style_of(tag_style)
    r, a = style.reasoning_tag, style.answer_tag
    count = 0.0
    if text.count(f"<{r}>\n") == 1:
        count += 0.125
    if text.count(f"\n</{r}>\n") == 1:
        count += 0.125
    if text.count(f"\n<{a}>\n") == 1:
        count += 0.125
        count -= len(text.split(f"\n</{a}>\n")[-1]) * 0.001
    if text.count(f"\n</{a}>") == 1:
        count += 0.125
        count -= (len(text.split(f"\n</{a}>")[-1]) - 1) * 0.001
    return count


def make_xmlcount(tag_style: TagStyle | str = "reasoning") -> RewardCallable:
    """``xmlcount``: ``count_xml`` of each completion (at most 0.5)."""
    style = style_of(tag_style)

    def xmlcount(prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
        return [count_xml(final_text(c), style) for c in completions]

    return xmlcount


def make_soft_format(tag_style: TagStyle | str = "reasoning", dotall: bool = False) -> RewardCallable:
    r"""``soft_format``: 0.5 if the completion *starts with* ``<r>...</r>`` then whitespace then
    ``<answer>...</answer>`` (``re.match``; text after the answer is allowed), else 0.0.

    Quirk kept: the seed's ``re.match(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", r)`` has no
    DOTALL, so ``.`` stops at a newline and reasoning or an answer over several lines does not match
    (the usual ``<reasoning>\n...\n</reasoning>`` layout scores 0). ``dotall=True``
    (``params: {dotall: true}``) is the forgiving variant, where they match."""
    style = style_of(tag_style)
    r, a = style.reasoning_tag, style.answer_tag
    pattern = re.compile(rf"<{r}>.*?</{r}>\s*<{a}>.*?</{a}>", flags=re.DOTALL if dotall else 0)

    def soft_format(prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
        return [0.5 if pattern.match(final_text(c)) else 0.0 for c in completions]

    return soft_format


def make_strict_format(tag_style: TagStyle | str = "reasoning") -> RewardCallable:
    """``strict_format``: 0.5 if the completion is exactly ``<r>\\n...\\n</r>\\n<answer>\\n...\\n</answer>\\n``,
    else 0.0. Quirk kept: no DOTALL, so the reasoning and the answer must each fit on one line."""
    style = style_of(tag_style)
    r, a = style.reasoning_tag, style.answer_tag
    pattern = re.compile(rf"^<{r}>\n.*?\n</{r}>\n<{a}>\n.*?\n</{a}>\n$")

    def strict_format(prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
        return [0.5 if pattern.match(final_text(c)) else 0.0 for c in completions]

    return strict_format


def make_int_answer(tag_style: TagStyle | str = "reasoning") -> RewardCallable:
    """``int_answer``: 0.5 if the extracted answer (``extract_xml_answer``) is all digits, else 0.0."""
    style = style_of(tag_style)

    def int_answer(prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
        return [0.5 if extract_xml_answer(final_text(c), style).isdigit() else 0.0 for c in completions]

    return int_answer


def make_correctness(tag_style: TagStyle | str = "reasoning") -> RewardCallable:
    """``correctness``: 2.0 if the extracted answer (``extract_xml_answer``) is the string in column
    ``answer``, else 0.0. Quirk kept: exact string equality, so ``"1080"`` does not equal ``"1,080"``
    (use ``answer_correct`` for numeric equality)."""
    style = style_of(tag_style)

    def correctness(
        prompts: Sequence[Any],
        completions: Sequence[Completion],
        answer: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        golds = _require_answers("correctness", answer, kwargs)
        return [
            2.0 if extract_xml_answer(final_text(c), style) == str(g) else 0.0
            for c, g in zip(completions, golds, strict=True)
        ]

    return correctness
