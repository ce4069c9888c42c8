"""Token ids the chat template puts between a sampled assistant turn and the next one (the tool messages and
the next generation prompt), computed so that the tokens already in the context never change.

As TRL's ``_get_tool_suffix_ids``: render a stand-in conversation ending with an assistant tool call, then the
same with the tool messages and a generation prompt; the first rendering cut after its last end-of-turn token
is a prefix of the second, and what follows is the suffix. The sampled turn ended with that token, so
``context + suffix`` is exactly what the template would give, without re-tokenising the model's text.
"""

from __future__ import annotations

_STAND_IN = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}]


def _render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    return list(ids)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], end_of_turn_ids: list[int]) -> list[int]:
    """The ids of ``tool_messages`` ([{"role": "tool", "name", "content"}], one turn's results) and the next
    assistant generation prompt, to append after a sampled turn that ended with an end-of-turn id."""
    prefix = _render_ids(tokenizer, _STAND_IN, add_generation_prompt=False)
    full = _render_ids(tokenizer, _STAND_IN + tool_messages, add_generation_prompt=True)
    ends = [i for i, t in enumerate(prefix) if t in end_of_turn_ids]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving around tool messages: rendering a tool "
                         "result changes the tokens of the turn before it, so multi-turn rollouts cannot keep "
                         "the sampled tokens as they are")
    return full[len(prefix):]


def check_tool_template(tokenizer, schemas: list[dict]) -> None:
    """ValueError unless the chat template renders the tools' schemas and a tool conversation
    (user -> assistant with tool_calls -> tool), as multi-turn rollouts need."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; tools need one "
                         "that renders them (e.g. Qwen2.5's)")
    user = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    with_tools = tokenizer.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True)
    if plain == with_tools:
        raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} ignores tools= (the "
                         "prompt is the same with and without them), so the model would never see the tool "
                         "schemas; use a template with tool support (e.g. Qwen2.5's)")
    marker = "grpo-tool-result-7f3a"
    rendered = tokenizer.apply_chat_template(_STAND_IN + [{"role": "tool", "name": "f", "content": marker}],
                                             tokenize=False)
    if marker not in rendered:
        raise ValueError("the chat template does not render tool messages (role 'tool'); use a template with "
                         "tool support (e.g. Qwen2.5's)")
