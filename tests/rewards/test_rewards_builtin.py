"""Built-in rewards on hand-made completions, string and conversational, in both tag styles."""

from __future__ import annotations

import re

import pytest

from grpo.data.tags import get_tag_style
from grpo.rewards import get_reward_function

STYLES = ["think", "reasoning"]


def wrap(texts: list[str], as_messages: bool) -> list:
    """Completions as TRL passes them: strings, or one assistant message each."""
    return [[{"role": "assistant", "content": t}] for t in texts] if as_messages else list(texts)


def call(name: str, style: str, texts: list[str], as_messages: bool, **columns) -> list:
    fn = get_reward_function(name, tag_style=style)
    assert fn.__name__ == name  # TRL logs rewards by __name__
    prompts = ["Q?"] * len(texts)
    # An unknown keyword (TRL passes e.g. trainer_state) must be accepted and ignored.
    return fn(prompts, wrap(texts, as_messages), trainer_state=object(), **columns)


def strict(style: str, reasoning: str = "step", answer: str = "7", tail: str = "\n") -> str:
    """The exact layout the Unsloth strict format asks for."""
    r = get_tag_style(style).reasoning_tag
    return f"<{r}>\n{reasoning}\n</{r}>\n<answer>\n{answer}\n</answer>{tail}"


def test_soft_format_is_the_seeds_regex_exactly():
    # The seed's soft_format_reward_func, verbatim: re.match without flags.
    def seed(responses):
        pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
        return [0.5 if re.match(pattern, r) else 0.0 for r in responses]

    texts = ["<reasoning>a</reasoning><answer>1</answer>", "<reasoning>\na\n</reasoning>\n<answer>\n1\n</answer>\n",
             "<reasoning>a</reasoning>\n\n<answer>1</answer>tail", "x<reasoning>a</reasoning><answer>1</answer>",
             "<reasoning>a</reasoning><answer>1\n</answer>", ""]
    assert call("soft_format", "reasoning", texts, as_messages=True) == seed(texts) == [0.5, 0, 0.5, 0, 0, 0]


@pytest.mark.parametrize("as_messages", [False, True])
@pytest.mark.parametrize("style", STYLES)
class TestBuiltins:
    def test_answer_correct(self, style, as_messages):
        r = get_tag_style(style).reasoning_tag
        texts = [
            f"<{r}>2*540</{r}><answer>1080 dollars</answer>",  # numerically equal -> +1
            f"<{r}>..</{r}><answer>1081</answer>",  # wrong -> -1
            "the answer is 1080",  # no answer tag -> -1
            f"<{r}>..</{r}><answer>$1,080</answer>",  # gold given as a GSM8K solution -> +1
        ]
        golds = ["1,080", "1,080", "1,080", "540*2=<<540*2=1080>>1080\n#### 1080"]
        assert call("answer_correct", style, texts, as_messages, answer=golds) == [1.0, -1.0, -1.0, 1.0]

    def test_format_think_answer(self, style, as_messages):
        r = get_tag_style(style).reasoning_tag
        other = "reasoning" if r == "think" else "think"
        texts = [
            f"<{r}>\nx\n</{r}>\n<answer>\n7\n</answer>\n",  # well formed -> 1.25
            f"<{r}>x</{r}> <answer>7</answer>",  # whitespace between is fine -> 1.25
            f"<{r}>x</{r}><answer>7</answer> and more",  # text after -> -1
            f"<{other}>x</{other}><answer>7</answer>",  # the other style's tag -> -1
        ]
        assert call("format_think_answer", style, texts, as_messages) == [1.25, 1.25, -1.0, -1.0]

    def test_xmlcount(self, style, as_messages):
        r = get_tag_style(style).reasoning_tag
        perfect = strict(style)
        no_final_newline = strict(style, tail="")
        trailing = strict(style, tail="\nabc")
        answer_tags_only = "<answer>\n7\n</answer>\n"
        texts = [perfect, no_final_newline, trailing, answer_tags_only, f"<{r}>x</{r}>"]
        expected = [
            # four tags well placed, nothing after the answer: 4 * 0.125
            0.5,
            # "\n</answer>\n" is absent, so the third term's penalty measures the whole text
            # (script quirk), and the fourth gets -(0 - 1) * 0.001 = +0.001
            0.5 - len(no_final_newline) * 0.001 + 0.001,
            # "abc" after "\n</answer>\n" costs 3 * 0.001 in the third term; "\nabc" after
            # "\n</answer>" costs (4 - 1) * 0.001 in the fourth
            0.5 - 0.003 - 0.003,
            # only the two answer terms: "<answer>\n" is not "\n<answer>\n" (no leading newline) ->
            # only the fourth term, with "\n" after it: 0.125 - 0
            0.125,
            # no newlines around the tags: nothing counts
            0.0,
        ]
        assert call("xmlcount", style, texts, as_messages) == pytest.approx(expected, abs=1e-12)

    def test_soft_format(self, style, as_messages):
        r = get_tag_style(style).reasoning_tag
        texts = [
            f"<{r}>a b</{r}>\n\n<answer>7</answer> trailing text is allowed",  # re.match at start
            f"<{r}>a\nb</{r}>\n<answer>7</answer>",  # no DOTALL (the seed's quirk): multi-line reasoning fails
            f"<{r}>\na\n</{r}>\n<answer>\n7\n</answer>\n",  # ...and so does the usual layout
            f"Sure. <{r}>a</{r}><answer>7</answer>",  # must start with the reasoning tag
            f"<{r}>a</{r}> x <answer>7</answer>",  # only whitespace between the blocks
        ]
        assert call("soft_format", style, texts, as_messages) == [0.5, 0.0, 0.0, 0.0, 0.0]
        # dotall=True is the forgiving variant: the multi-line ones match, the rest as before
        forgiving = get_reward_function("soft_format", tag_style=style, dotall=True)
        assert forgiving(["Q?"] * 5, wrap(texts, as_messages)) == [0.5, 0.5, 0.5, 0.0, 0.0]

    def test_strict_format(self, style, as_messages):
        texts = [
            strict(style),  # exact layout
            strict(style, reasoning="line 1\nline 2"),  # no DOTALL: multi-line reasoning fails (quirk)
            strict(style, tail=""),  # the final newline is required
            strict(style, tail="\nmore"),  # and nothing after it...
            strict(style, tail="\n\n"),  # ...except one more newline: "$" also matches before a final "\n"
        ]
        assert call("strict_format", style, texts, as_messages) == [0.5, 0.0, 0.0, 0.0, 0.5]

    def test_int_answer(self, style, as_messages):
        texts = [
            strict(style, answer="42"),
            strict(style, answer="4.5"),
            strict(style, answer="-3"),  # "-3".isdigit() is False
            strict(style, answer="1,080"),
            "42",  # no tags: the whole completion is "the answer" (script quirk)
        ]
        assert call("int_answer", style, texts, as_messages) == [0.5, 0.0, 0.0, 0.0, 0.5]

    def test_correctness(self, style, as_messages):
        texts = [
            strict(style, answer="1080"),  # exact string match -> 2.0
            strict(style, answer="1080"),  # "1080" != "1,080" as strings -> 0.0 (use answer_correct)
            "7",  # no tags: the whole completion is compared (script quirk) -> 2.0
            strict(style, answer="8"),
        ]
        golds = ["1080", "1,080", "7", "7"]
        assert call("correctness", style, texts, as_messages, answer=golds) == [2.0, 0.0, 2.0, 0.0]


def test_default_tag_styles():
    # Without a tag style, the project's rewards check <think>, the Unsloth five <reasoning>.
    think = "<think>\nx\n</think>\n<answer>\n7\n</answer>\n"
    reasoning = "<reasoning>\nx\n</reasoning>\n<answer>\n7\n</answer>\n"
    assert get_reward_function("format_think_answer")(["q", "q"], [think, reasoning]) == [1.25, -1.0]
    assert get_reward_function("strict_format")(["q", "q"], [think, reasoning]) == [0.0, 0.5]


def test_tag_style_object_accepted():
    fn = get_reward_function("strict_format", tag_style=get_tag_style("think"))
    assert fn(["q"], [strict("think")]) == [0.5]


@pytest.mark.parametrize("name", ["answer_correct", "correctness"])
def test_missing_answer_column_is_a_clear_error(name):
    fn = get_reward_function(name)
    with pytest.raises(ValueError, match=rf"{name}.*'answer'.*\['solution'\]"):
        fn(["q"], ["<answer>1</answer>"], solution=["1"])


def test_multi_turn_completions_are_judged_on_their_last_assistant_message():
    """A completion that called a tool (assistant turn with tool_calls, the tool's result, the answer turn) is
    well formatted and right when its final answer is; the turns before it are not part of the format."""
    from grpo.rewards import get_reward_function

    answer = "<think>\n4821 * 37 = 178377\n</think>\n<answer>\n178377\n</answer>"
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                               "arguments": {"expression": "4821 * 37"}}}]}
    used_tool = [call, {"role": "tool", "name": "calculator", "content": "178377"},
                 {"role": "assistant", "content": answer}]
    alone = [{"role": "assistant", "content": answer}]
    stopped_at_call = [call, {"role": "tool", "name": "calculator", "content": "178377"}]
    fmt, correct = get_reward_function("format_think_answer"), get_reward_function("answer_correct")
    assert fmt(prompts=[None] * 3, completions=[used_tool, alone, stopped_at_call]) == [1.25, 1.25, -1.0]
    assert correct(prompts=[None] * 3, completions=[used_tool, alone, stopped_at_call], answer=["178377"] * 3) == [1.0, 1.0, -1.0]
