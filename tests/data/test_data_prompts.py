"""Prompt building and rendering through a chat template."""

from __future__ import annotations

import copy

import pytest

from grpo.data import (
    Example,
    build_prompt_messages,
    default_system_prompt,
    render_example,
    render_prompt,
    resolve_system_prompt,
)
from grpo.data.prompts import with_template_variables
from grpo.data.tags import get_tag_style

EXAMPLE = Example(
    messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is 6 * 7?"},
    ],
    answer="42",
    answer_raw="42",
    source="mem:1",
)


def test_default_system_prompt_follows_the_tag_style() -> None:
    assert default_system_prompt() == get_tag_style("think").system_prompt
    assert "<reasoning>" in default_system_prompt("reasoning")
    with pytest.raises(ValueError, match="known"):
        default_system_prompt("xml")


def test_config_null_means_the_tag_style_default() -> None:
    assert resolve_system_prompt(None, "reasoning") == default_system_prompt("reasoning")
    assert resolve_system_prompt("Custom.", "reasoning") == "Custom."
    assert resolve_system_prompt("", "think") == ""  # an explicit empty prompt is kept, not replaced


def test_build_prompt_messages_prepends_the_system_turn_and_copies() -> None:
    messages = build_prompt_messages(EXAMPLE, "Be brief.")
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1:] == EXAMPLE.messages
    messages[1]["content"] = "changed"
    assert EXAMPLE.messages[0]["content"] == "Hi"  # the example is not aliased
    assert build_prompt_messages(EXAMPLE, None) == EXAMPLE.messages


def test_render_prompt_has_system_history_and_generation_prompt(tiny_tokenizer) -> None:
    system = default_system_prompt("think")
    text = render_prompt(tiny_tokenizer, build_prompt_messages(EXAMPLE, system))
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n")
    assert "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert render_example(tiny_tokenizer, EXAMPLE, system) == text


def test_render_prompt_without_chat_template_names_the_tokenizer() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")), name_or_path="some/base-model"
    )
    with pytest.raises(ValueError, match=r"tokenizer 'some/base-model' has no chat template"):
        render_prompt(bare, build_prompt_messages(EXAMPLE, "sys"))


def test_template_variables_reach_every_rendering_of_a_copy(tiny_tokenizer) -> None:
    # TRL's chat_template_kwargs: Qwen3's template reads enable_thinking; a toy template reads it and a dict
    original = tiny_tokenizer.chat_template
    tokenizer = copy.copy(tiny_tokenizer)
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
                               "{{ extra.tag if extra is defined else '' }}" + original)
    rendering = with_template_variables(tokenizer, {"enable_thinking": False, "extra": {"tag": "a\"b", "n": [1, None]}})
    text = render_prompt(rendering, build_prompt_messages(EXAMPLE, None))
    assert text == "<no-think>a\"b" + render_prompt(tiny_tokenizer, build_prompt_messages(EXAMPLE, None))
    assert render_prompt(with_template_variables(tokenizer, {"enable_thinking": True}),
                         build_prompt_messages(EXAMPLE, None)).startswith("<|im_start|>")
    assert tokenizer.chat_template.endswith(original) and "set" not in tokenizer.chat_template[:60]  # not mutated
    assert with_template_variables(tokenizer, None) is tokenizer and with_template_variables(tokenizer, {}) is tokenizer


def test_template_variables_refuse_what_a_template_cannot_take(tiny_tokenizer) -> None:
    with pytest.raises(ValueError, match="not a template variable name"):
        with_template_variables(tiny_tokenizer, {"enable-thinking": False})
    with pytest.raises(ValueError, match=r"chat_template_kwargs\['when'\] is a object"):
        with_template_variables(tiny_tokenizer, {"when": object()})
