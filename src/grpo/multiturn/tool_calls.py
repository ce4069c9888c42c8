"""Tool calls read from a sampled turn, in the format the chat template teaches the model.

One format by registry: ``hermes``, the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
of Qwen2.5/Qwen3, Hermes and most open chat templates. A template that renders tools but no format grpo
reads is refused when the run starts (``detect_format``), never discovered as "the model never calls".

A block that is not valid JSON, or names no function, is a *malformed* call: it is answered with an error
tool message (and counted as a failure), so the model learns what went wrong instead of the call vanishing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from grpo.config.kinds import AUTO, TOOL_CALL_MARKERS


@dataclass(frozen=True)
class ToolCall:
    """One call the model made. ``error`` is set (and name/arguments may be empty) when it was malformed."""

    name: str
    arguments: Any
    error: str | None = None

    def message(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (TRL's and transformers' layout)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``(content before the first call, calls)`` of one assistant turn's decoded text."""
    first = text.find("<tool_call>")
    if first < 0:
        return text, []
    calls = []
    for block in _HERMES_BLOCK.findall(text[first:]):
        body = block.strip()
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", None, f"the tool call is not valid JSON ({exc.msg} at {exc.pos}): {body[:200]!r}"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall("", None, f"the tool call names no function: {body[:200]!r}"))
            continue
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append(ToolCall(data["name"], arguments))
    return text[:first].rstrip(), calls


# Parsers of the formats declared (with the marker ``auto`` recognises) in grpo.config.kinds.TOOL_CALL_MARKERS.
TOOL_CALL_FORMATS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {"hermes": parse_hermes}


def detect_format(chat_template: str | None, name: str = AUTO) -> str:
    """The format to parse with: ``name`` when given, else the one whose marker the template renders."""
    if name != AUTO:
        if name not in TOOL_CALL_FORMATS:
            raise ValueError(f"rollout.tool_call_format {name!r}; known: {AUTO}, {', '.join(TOOL_CALL_FORMATS)}")
        return name
    for fmt, marker in TOOL_CALL_MARKERS.items():
        if chat_template and marker in chat_template:
            return fmt
    raise ValueError("the chat template renders no tool-call format grpo can read (known: "
                     f"{', '.join(f'{k} ({v})' for k, v in TOOL_CALL_MARKERS.items())}); use a template with tool "
                     "support (e.g. Qwen2.5's) or set rollout.tool_call_format")
