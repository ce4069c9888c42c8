"""Answer extraction, format check and answer equality (grpo.rewards.answers)."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest

from grpo.data.tags import get_tag_style
from grpo.rewards import answers_equal, completion_text, extract_answer, is_well_formatted
from grpo.rewards.answers import gold_answer, parse_plain_number


@pytest.mark.parametrize("pred", ["1,080", "1080", "1080.0", "$1,080", "1080 dollars", " 1080 ", "1080.", "$ 1080.00"])
def test_numeric_forms_equal_gold_with_thousands_separator(pred):
    # All of these read as the decimal 1080 on the plain-number path.
    assert answers_equal(pred, "1,080")


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("1081", "1,080"),  # off by one
        ("", "5"),  # empty prediction is never correct
        ("   ", "5"),
        (None, "5"),  # no answer tag
        ("10,80", "1,080"),  # malformed grouping is not a plain number; math-verify does not read 1080
        ("-5", "5"),  # sign matters
        ("5", ""),  # an empty gold matches nothing
        ("x+1", "1"),  # the whole answer counts, not the last number in it
    ],
)
def test_unequal_answers(pred, gold):
    assert not answers_equal(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("\\frac{1}{2}", "0.5"),  # LaTeX fraction vs decimal: math-verify
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "0.5"),
        ("$\\frac{3}{4}$", "0.75"),  # already delimited LaTeX
        ("x = 3", "3"),  # an assignment's value
        ("\\boxed{18}", "18"),
        ("-$5", "-5"),
        ("50%", "50"),  # GSM8K golds are bare numbers; the percent sign is a unit here
    ],
)
def test_math_verify_and_special_forms_equal(pred, gold):
    assert answers_equal(pred, gold)


def test_frac_not_equal_to_other_value():
    assert not answers_equal("\\frac{1}{3}", "0.5")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,080", Decimal(1080)),
        ("$1,234,567.5", Decimal("1234567.5")),
        ("-3", Decimal(-3)),
        ("+3", Decimal(3)),
        (".5", Decimal("0.5")),
        ("12 cm", Decimal(12)),
        ("1/2", None),
        ("1,08", None),
        ("", None),
        ("five", None),
        ("1e5", None),
        ("$", None),
    ],
)
def test_parse_plain_number(text, value):
    assert parse_plain_number(text) == value


def test_gold_answer_reads_gsm8k_solutions():
    assert gold_answer("She has 3+4=<<3+4=7>>7 apples.\n#### 7") == "7"
    assert gold_answer(" 1,080 ") == "1,080"


@pytest.mark.parametrize("style", ["think", "reasoning"])
def test_extract_answer_takes_last_pair(style):
    r = get_tag_style(style).reasoning_tag
    text = f"<{r}>the format is <answer>x</answer></{r}>\n<answer>\n 42 \n</answer>"
    assert extract_answer(text, style) == "42"
    assert extract_answer("no tags, 42", style) is None
    assert extract_answer("<answer>42", style) is None  # unclosed


@pytest.mark.parametrize("style", ["think", "reasoning"])
def test_is_well_formatted(style):
    r = get_tag_style(style).reasoning_tag
    other = "reasoning" if r == "think" else "think"
    assert is_well_formatted(f"<{r}>\nstep\n</{r}>\n<answer>\n7\n</answer>", style)
    assert is_well_formatted(f"  \n<{r}>a</{r}><answer>7</answer>\n\n", style)  # whitespace around is fine
    assert not is_well_formatted(f"Sure! <{r}>a</{r}><answer>7</answer>", style)  # text before
    assert not is_well_formatted(f"<{r}>a</{r}><answer>7</answer> done", style)  # text after
    assert not is_well_formatted(f"<{r}>a</{r}> so <answer>7</answer>", style)  # text between
    assert not is_well_formatted(f"<{r}>a</{r}><answer>7</answer><answer>8</answer>", style)  # two answers
    assert not is_well_formatted(f"<answer>7</answer><{r}>a</{r}>", style)  # wrong order
    assert not is_well_formatted(f"<{other}>a</{other}><answer>7</answer>", style)  # the other style's tag
    assert not is_well_formatted(f"<{r}>a</{r}>", style)  # no answer


def test_completion_text_of_conversational_completions():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]
    assert completion_text(parts) == "ab"


def test_math_verify_path_works_off_the_main_thread():
    # math-verify's default timeout uses signal.alarm, which raises off the main thread; a trainer
    # may score in a worker thread, so equality must work (and be right) there too.
    results: dict[str, object] = {}

    def work() -> None:
        try:
            results["frac"] = answers_equal("\\frac{1}{2}", "0.5")
            results["wrong"] = answers_equal("\\frac{1}{3}", "0.5")
        except Exception as error:  # reported below; a thread would otherwise swallow it
            results["error"] = error

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert "error" not in results, results.get("error")
    assert results == {"frac": True, "wrong": False}
