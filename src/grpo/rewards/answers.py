"""Reading a completion: its text, its tagged answer, whether it is well formatted, and answer equality.

These helpers are shared by the built-in rewards and by the trainer's ``accuracy`` / ``format_rate``
metrics, so that a metric and the reward it mirrors can never disagree.

Equality (``answers_equal``) has two paths:
- a fast exact path when both sides are *plain numbers* after light normalisation (``"$1,080"``,
  ``"1080.0"``, ``"1080 dollars"`` all read as the decimal 1080); this covers every GSM8K gold
  answer and never calls math-verify, which parses with sympy and is far slower;
- math-verify (``parse`` + ``verify``) for everything else (``\\frac{1}{2}`` vs ``0.5``, ``2\\pi``, ``x=3``).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Any

from grpo.data.tags import TagStyle, get_tag_style

# math-verify's own default, in seconds, for each parse and each comparison.
MATH_VERIFY_TIMEOUT_S = 5

# A plain number: optional sign, optional currency sign, digits with or without thousands separators,
# optional decimals, then optional unit words or a percent sign ("1080 dollars", "12 cm", "50%").
# Units are dropped on purpose: GSM8K golds are bare numbers while models often add the unit.
_PLAIN_NUMBER = re.compile(
    r"""^
    (?P<sign>[-+]?)\s*\$?\s*(?P<sign_after_currency>[-+]?)
    (?P<integer>\d{1,3}(?:,\d{3})+|\d+)?
    (?P<fraction>\.\d+)?
    (?:\s*%|(?:\s+[A-Za-z]+)+)?
    \.?   # a sentence-ending full stop: "The answer is 18." -> "18."
    $""",
    re.VERBOSE,
)


def style_of(tag_style: TagStyle | str) -> TagStyle:
    """Accept a ``TagStyle`` or its registry name (``"think"`` / ``"reasoning"``)."""
    return tag_style if isinstance(tag_style, TagStyle) else get_tag_style(tag_style)


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion, as TRL passes it to reward functions.

    A standard completion is a string. A conversational one is a list of messages
    (``[{"role": "assistant", "content": ...}]``); its text is the concatenation of the messages'
    contents (one message in the usual case), where a content may also be a list of
    ``{"type": "text", "text": ...}`` parts.
    """
    if isinstance(completion, str):
        return completion
    parts: list[str] = []
    for message in completion:
        content = message.get("content") or ""
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(part.get("text", "") for part in content if part.get("type") == "text")
    return "".join(parts)


def final_text(completion: str | list[dict[str, Any]]) -> str:
    """The text a completion's answer and format are judged on: the last assistant message of a multi-turn
    completion (its turns before that called tools and read their results), else ``completion_text``."""
    if isinstance(completion, str) or not any(m.get("role") == "tool" for m in completion):
        return completion_text(completion)
    return completion_text([m for m in completion if m.get("role") == "assistant"][-1:])


def extract_answer(text: str, tag_style: TagStyle | str = "think") -> str | None:
    """The stripped content of the *last* ``<answer>...</answer>`` pair, or None when there is none.

    The last pair is taken because a model may quote the format in its reasoning before answering.
    """
    tag = style_of(tag_style).answer_tag
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def is_well_formatted(text: str, tag_style: TagStyle | str = "think") -> bool:
    """True when ``text`` is exactly ``<r>...</r>`` then ``<answer>...</answer>``.

    Whitespace is allowed before, between and after the two blocks; nothing else is. Each of the
    four tags must occur exactly once, so a second ``<answer>`` block (which a non-greedy regex
    alone would swallow into the first block's content) is rejected.
    """
    style = style_of(tag_style)
    tags = [
        f"<{style.reasoning_tag}>",
        f"</{style.reasoning_tag}>",
        f"<{style.answer_tag}>",
        f"</{style.answer_tag}>",
    ]
    if any(text.count(tag) != 1 for tag in tags):
        return False
    r, a = style.reasoning_tag, style.answer_tag
    return re.fullmatch(rf"\s*<{r}>.*</{r}>\s*<{a}>.*</{a}>\s*", text, flags=re.DOTALL) is not None


def gold_answer(gold: str) -> str:
    """The gold answer from a dataset column: a bare answer, or a GSM8K solution ending ``#### x``."""
    return gold.split("####")[-1].strip() if "####" in gold else gold.strip()


def parse_plain_number(text: str) -> Decimal | None:
    """The value of ``text`` when it is a plain number (see ``_PLAIN_NUMBER``), else None.

    Examples: ``"1,080"``, ``"$1,080"``, ``"1080.0"``, ``"1080 dollars"``, ``"-3"``, ``"50%"`` -> a
    Decimal; ``"1/2"``, ``"\\frac{1}{2}"``, ``"1,08"``, ``""``, ``"five"`` -> None.
    """
    match = _PLAIN_NUMBER.match(text.strip())
    if match is None or (match["integer"] is None and match["fraction"] is None):
        return None
    if match["sign"] and match["sign_after_currency"]:
        return None  # "-$-5" is not a number anyone means
    sign = match["sign"] or match["sign_after_currency"]
    digits = (match["integer"] or "0").replace(",", "") + (match["fraction"] or "")
    try:
        return Decimal(sign + digits)
    except InvalidOperation:  # unreachable for the regex above; kept so a regex edit fails soft
        return None


def answers_equal(pred: str | None, gold: str) -> bool:
    """Whether a predicted answer equals the gold one.

    Exact decimal comparison when both sides are plain numbers (``"1,080" == "1080.0"``,
    ``"1081" != "1,080"``); otherwise math-verify, with ``gold`` as its (asymmetric) gold side.
    An empty or missing prediction is never equal.
    """
    if pred is None or not pred.strip() or not gold.strip():
        return False
    pred_number, gold_number = parse_plain_number(pred), parse_plain_number(gold)
    if pred_number is not None and gold_number is not None:
        return pred_number == gold_number
    # Hand math-verify the normalised form of a side that is a plain number, so "$1,080" does not
    # meet its LaTeX parser (where "," may be read as a tuple separator).
    # format "f": str(Decimal) may use exponent notation ("1E-7"), which LaTeX parsing misreads.
    pred_text = format(pred_number, "f") if pred_number is not None else pred
    gold_text = format(gold_number, "f") if gold_number is not None else gold
    return _math_verify_equal(pred_text, gold_text)


def _math_verify_timeout() -> int | None:
    """math-verify's timeout, or None off the main thread.

    math-verify times out with ``signal.alarm``, which only works on the main thread; elsewhere
    ``parse``/``verify`` raise ValueError unless the timeout is disabled. Off the main thread we
    therefore run without a timeout (the plain-number path above keeps that case rare and cheap).
    """
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math_parse(text: str, timeout: int | None) -> list[Any]:
    """Parse an answer with math-verify, reading an undelimited answer as LaTeX first.

    An ``<answer>`` body is the whole answer, so ``x+1`` must stay ``x+1``: math-verify's plain
    expression extractor would pick out the number ``1``. Wrapping in ``$...$`` keeps the whole
    expression; the plain extractor is only the fallback when that finds nothing.
    """
    # On first use: math-verify's LaTeX parser costs 0.1 s of import, and most answers are plain numbers.
    from math_verify import parse

    if "$" not in text and "\\(" not in text and "\\[" not in text:
        parsed = parse(f"${text}$", parsing_timeout=timeout)
        if parsed:
            return parsed
    return parse(text, parsing_timeout=timeout)


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import verify  # on first use, as in _math_parse

    timeout = _math_verify_timeout()
    gold_parsed = _math_parse(gold, timeout)
    pred_parsed = _math_parse(pred, timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
