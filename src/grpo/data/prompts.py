"""From an Example to the prompt text the policy sees: system prompt + history, through the chat template.

The system prompt is a setting of the run (default: the one of the answer tag style, so that the
format the prompt asks for is the format the reward checks); the history comes from the data.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from grpo.data.example import Example
from grpo.data.tags import get_tag_style


def default_system_prompt(tag_style: str = "think") -> str:
    """The system prompt asking for the answer format of the named tag style ("think" | "reasoning")."""
    return get_tag_style(tag_style).system_prompt


def resolve_system_prompt(system_prompt: str | None, tag_style: str = "think", add: bool = True) -> str | None:
    """The config's `data.system_prompt` if set, else the tag style's default (config null = default);
    None when ``add`` is False (`data.add_system_prompt: false`: no system turn from the run, as TRL renders
    its prompts; a row's own system turn, `Example.system`, still applies)."""
    if not add:
        return None
    return default_system_prompt(tag_style) if system_prompt is None else system_prompt


def build_prompt_messages(example: Example, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat to render: ``[{"role": "system", ...}] + example.messages``.

    system_prompt: the system turn's text; None leaves the system turn out (for models whose chat
    template has no system role). This is not the config's null: resolve that first with
    `resolve_system_prompt`. (Qwen2.5's template adds its own default system turn when there is none.)
    The example's messages are copied, never shared.
    """
    history = [dict(message) for message in example.messages]
    if example.system is not None:  # the row's own (the Python API's datasets)
        system_prompt = example.system
    if system_prompt is None:
        return history
    return [{"role": "system", "content": system_prompt}, *history]


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """Render messages with the tokenizer's chat template, ending with the assistant's generation prompt.

    tokenizer: a `transformers` tokenizer with a `chat_template`. Raises ValueError naming the
    tokenizer (its `name_or_path`) if it has none: base models often ship without one, and
    a silent plain-text fallback would train on prompts the model never sees at inference.
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template; use an instruct/chat model's tokenizer "
            "or set tokenizer.chat_template to a Jinja template"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def render_example(tokenizer: Any, example: Example, system_prompt: str | None) -> str:
    """``render_prompt(tokenizer, build_prompt_messages(example, system_prompt))``; a plain-text example's
    text as it is (TRL's non-conversational prompts get no chat template)."""
    if example.plain_text:
        return example.question
    return render_prompt(tokenizer, build_prompt_messages(example, system_prompt))


def _jinja_literal(value: Any, key: str) -> str:
    """``value`` (JSON-like: bool, None, number, text, list, dict) as a Jinja literal."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    if isinstance(value, (int, float, str)):
        return json.dumps(value)  # JSON's string escapes are Jinja's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_jinja_literal(v, key) for v in value) + "]"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{json.dumps(k)}: {_jinja_literal(v, key)}" for k, v in value.items()) + "}"
    raise ValueError(f"chat_template_kwargs[{key!r}] is a {type(value).__name__}; the template's variables may be "
                     "booleans, None, numbers, text, lists or dicts of these")


def with_template_variables(tokenizer: Any, variables: dict[str, Any] | None) -> Any:
    """A copy of ``tokenizer`` whose chat template starts by setting ``variables`` (TRL's
    ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``), so every rendering of the run - prompts,
    tool turns, length checks - sees them; the tokenizer itself when there are none."""
    if not variables:
        return tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ValueError("chat_template_kwargs is set but the tokenizer has no chat template (one string) to pass "
                         "them to")
    settings = []
    for key, value in variables.items():
        if not (isinstance(key, str) and key.isidentifier()):
            raise ValueError(f"chat_template_kwargs key {key!r} is not a template variable name")
        settings.append(f"{{%- set {key} = {_jinja_literal(value, key)} -%}}")
    rendering = copy.copy(tokenizer)
    rendering.chat_template = "".join(settings) + template
    return rendering
