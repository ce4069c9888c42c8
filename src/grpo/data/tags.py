"""Answer tag styles shared by prompts (what the model is asked to write) and rewards (what is checked).

Two styles are supported, as in the seeds:
- ``think``:     ``<think>...</think><answer>...</answer>`` (DeepSeek-R1 style)
- ``reasoning``: ``<reasoning>...</reasoning><answer>...</answer>`` (TRL / Unsloth GSM8K recipes)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TagStyle:
    """Names of the two tags a completion is asked to contain."""

    name: str  # registry key: "think" or "reasoning"
    reasoning_tag: str  # e.g. "think" -> <think>...</think>
    answer_tag: str = "answer"

    @property
    def system_prompt(self) -> str:
        """The default system prompt asking for this format."""
        r, a = self.reasoning_tag, self.answer_tag
        return (
            f"Respond in the following format:\n<{r}>\n...\n</{r}>\n<{a}>\n...\n</{a}>\n"
            f"Think step by step inside <{r}> tags, then give only the final number inside <{a}> tags."
        )

    def completion(self, reasoning: str, answer: str) -> str:
        """A completion in this format: what the system prompt asks for and the format rewards accept."""
        r, a = self.reasoning_tag, self.answer_tag
        return f"<{r}>\n{reasoning}\n</{r}>\n<{a}>\n{answer}\n</{a}>"


TAG_STYLES: dict[str, TagStyle] = {
    "think": TagStyle(name="think", reasoning_tag="think"),
    "reasoning": TagStyle(name="reasoning", reasoning_tag="reasoning"),
}


def get_tag_style(name: str) -> TagStyle:
    """Look a tag style up by name; an unknown name lists the known ones."""
    try:
        return TAG_STYLES[name]
    except KeyError:
        raise ValueError(f"unknown tag style {name!r}; known: {sorted(TAG_STYLES)}") from None
