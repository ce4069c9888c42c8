"""The record every loader returns (`Example`) and the error every loader raises (`DataError`).

An `Example` is one prompt of the training or evaluation set: the chat history up to and
including the user's last turn (no system prompt: that is chosen by the run's config and added
by `grpo.data.prompts.build_prompt_messages`), the gold answer if there is one, and where it
came from, so that a sample or an error can point back at the exact line of the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Roles allowed in a stored history. "system" is left out on purpose: the system prompt is a
# setting of the run, and a second one hidden in the data would silently change every prompt.
HISTORY_ROLES = ("user", "assistant")


class DataError(ValueError):
    """A dataset file (or source string) is malformed; the message names the file and line."""


class PromptTooLong(DataError):
    """A rendered prompt (``what``: "prompt", "prompt with its tools") is over ``data.max_prompt_length``; the
    fields let a caller that speaks another vocabulary (the Python API) say it in its own words."""

    def __init__(self, source: str, length: int, limit: int, what: str = "prompt"):
        self.source, self.length, self.limit, self.what = source, length, limit, what
        super().__init__(f"{source}: {what} is {length} tokens, over data.max_prompt_length {limit}; raise it or "
                         "drop the example")


@dataclass(frozen=True)
class Example:
    """One prompt with its gold answer.

    messages:   chat history without a system prompt, ``[{"role", "content"}, ...]``, ending
                with the user turn the model must answer (roles: "user" / "assistant").
    answer:     normalised gold answer (stripped; thousands commas removed from numbers), or
                None for prompt-only datasets.
    answer_raw: the gold answer as written in the file (e.g. "1,080"), or None.
    source:     where the example came from, e.g. "data/train.jsonl:17" or "synthetic:seed=1#4".
    solution:   reference worked solution (GSM8K text before "####"), or None; used for SFT.

    The Python API's datasets (``grpo.api``) are TRL's, and three fields keep what TRL does with them
    (file loaders leave them at their defaults):
    system:     the row's own system turn, used instead of the run's system prompt.
    row:        the row's columns but ``prompt``, passed to reward functions verbatim (``columns()``).
    plain_text: the prompt is text, not a chat: used as written (no chat template), and rewards get
                prompts and completions as strings; ``messages`` is then its one user turn.
    """

    messages: list[dict[str, str]]
    answer: str | None
    answer_raw: str | None
    source: str
    solution: str | None = None
    system: str | None = None
    row: dict[str, Any] | None = None
    plain_text: bool = False

    def __post_init__(self) -> None:
        # Checked here so that no code path (loader, generator, test) can build a prompt the
        # chat template would render wrongly; loaders check first to add the line number.
        problem = history_problem(self.messages)
        if problem is not None:
            raise DataError(f"{self.source}: {problem}")

    @property
    def question(self) -> str:
        """Text of the last user turn (the question the model must answer)."""
        return self.messages[-1]["content"]

    def columns(self) -> dict[str, Any]:
        """The dataset columns passed to reward functions as keyword arguments."""
        if self.row is not None:
            return dict(self.row)
        return {
            "question": self.question,
            "answer": self.answer,
            "answer_raw": self.answer_raw,
            "solution": self.solution,
            "source": self.source,
        }


def history_problem(messages: Any) -> str | None:
    """Say what is wrong with a chat history, or return None if it is a valid `Example.messages`."""
    if not isinstance(messages, list) or not messages:
        return f"chat history must be a non-empty list of messages, got {_short(messages)}"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return f"message {index} must be a dict with keys 'role' and 'content', got {_short(message)}"
        if message["role"] not in HISTORY_ROLES:
            return (
                f"message {index} has role {message['role']!r}; allowed roles: {list(HISTORY_ROLES)} "
                "(the system prompt is set by the run's config, not stored in the data)"
            )
        if not isinstance(message["content"], str):
            return f"message {index} content must be a string, got {_short(message['content'])}"
    if messages[-1]["role"] != "user":
        return f"chat history must end with a user turn, but the last role is {messages[-1]['role']!r}"
    return None


def _short(value: Any, limit: int = 80) -> str:
    """repr() cut to `limit` characters, so that an error about a huge row stays readable."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
