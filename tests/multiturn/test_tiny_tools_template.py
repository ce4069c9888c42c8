"""The compact tool chat template of assets/tiny-tools (scripts/tiny_tool_sft_data.py): what it renders, that
the driver can use it (hermes calls, tool messages, prefix-preserving), and that without tools it is
tiny-math's template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.multiturn.calculator import calculator
from grpo.multiturn.conversation import check_tool_template, tool_suffix_ids
from grpo.multiturn.tool_calls import detect_format, parse_hermes
from grpo.multiturn.tools import tool_schema

ASSETS = Path(__file__).resolve().parents[2] / "assets"
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "4821 * 37"}}}]}
PROMPT = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "What is 4821 * 37?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS / "tiny-tools")


def test_the_asset_ships_the_script_template(tokenizer):
    import sys

    sys.path.insert(0, str(ASSETS.parent / "scripts"))
    try:
        from tiny_tool_sft_data import CHAT_TEMPLATE
    finally:
        sys.path.pop(0)
    assert tokenizer.chat_template == CHAT_TEMPLATE == (ASSETS / "tiny-tools" / "chat_template.jinja").read_text()
    assert detect_format(tokenizer.chat_template) == "hermes"


def test_tools_render_as_one_json_line_each_in_the_system_turn(tokenizer):
    text = tokenizer.apply_chat_template(PROMPT, tools=[tool_schema(calculator)], tokenize=False,
                                         add_generation_prompt=True)
    header = "<|im_start|>system\nAnswer.\n<tools>\n"
    assert text.startswith(header)
    line = text[len(header):text.index("\n</tools><|im_end|>\n")]
    assert json.loads(line) == {"name": "calculator", "parameters": {"expression": "string"}}
    assert text.endswith("<|im_start|>user\nWhat is 4821 * 37?<|im_end|>\n<|im_start|>assistant\n")
    # Without a system message the tools still get a system turn.
    bare = tokenizer.apply_chat_template(PROMPT[1:], tools=[tool_schema(calculator)], tokenize=False)
    assert bare.startswith("<|im_start|>system\n<tools>\n{")


def test_without_tools_it_is_tiny_maths_template(tokenizer):
    from transformers import AutoTokenizer

    math = AutoTokenizer.from_pretrained(ASSETS / "tiny-math")
    conversation = PROMPT + [{"role": "assistant", "content": "<think>\nx\n</think>\n<answer>\n1\n</answer>"}]
    for messages, prompt in ((PROMPT, True), (conversation, False)):
        assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                == math.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))


def test_a_tool_conversation_is_what_the_driver_builds_token_by_token(tokenizer):
    # The driver keeps the sampled ids and appends tool_suffix_ids; the result must be the template's own
    # rendering of the whole conversation, and the call must parse back from the decoded turn.
    tools = [tool_schema(calculator)]
    check_tool_template(tokenizer, tools)
    eos = tokenizer.eos_token_id
    result = {"role": "tool", "name": "calculator", "content": calculator("4821 * 37")}
    answer = {"role": "assistant", "content": "<think>\n4821 * 37 = 178377\n</think>\n<answer>\n178377\n</answer>"}

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = tokenizer.apply_chat_template(PROMPT, tools=tools, tokenize=False, add_generation_prompt=True)
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>'
    ids = encode(prompt) + encode(call_text) + [eos]
    content, calls = parse_hermes(tokenizer.decode(encode(call_text) + [eos], skip_special_tokens=True))
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "4821 * 37"})]
    ids += tool_suffix_ids(tokenizer, [result], [eos])
    ids += encode(answer["content"]) + [eos]
    whole = tokenizer.apply_chat_template(PROMPT + [CALL, result, answer], tools=tools, tokenize=False)
    assert tokenizer.decode(ids) + "\n" == whole
