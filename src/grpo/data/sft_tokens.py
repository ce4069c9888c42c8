"""SFT pairs as tokens (for PTX): the prompt rendered exactly as an RL prompt, then the response's tokens
and the EOS, cut to a maximum length; counts of what was cut or left out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from grpo.data import DataError, SftPair, build_prompt_messages, render_prompt


@dataclass(frozen=True)
class TokenizedPair:
    """A pair as token ids: ``prompt_ids`` (chat-templated, ending with the generation prompt) and
    ``response_ids`` (the response's tokens, then the EOS unless ``max_length`` cut them)."""

    prompt_ids: list[int]
    response_ids: list[int]
    source: str


@dataclass(frozen=True)
class Tokenized:
    """What ``tokenize_pairs`` kept, and how many pairs it had to shorten (``cut``) or leave out (``dropped``)."""

    rows: list[TokenizedPair]
    cut: int
    dropped: int


def tokenize_pairs(tokenizer, pairs: Sequence[SftPair], system_prompt: str | None, max_length: int) -> Tokenized:
    """The pairs as token ids, each at most ``max_length`` tokens of prompt + response.

    The prompt and the response are tokenized apart, as the rollout sees them (the prompt's ids, then the
    sampled ones). A response that does not fit loses its end (and its EOS); a pair whose prompt alone
    leaves no room for a response token is left out. An SFT set's long tail should not stop a run, every
    token kept is still a correct next-token target, and both counts are reported (``load_ptx_data`` prints
    them). When no pair fits at all: DataError naming the first pair's file and line.
    """
    prompts = [render_prompt(tokenizer, build_prompt_messages(p.prompt, system_prompt)) for p in pairs]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer([p.response for p in pairs], add_special_tokens=False)["input_ids"]
    rows, cut, dropped = [], 0, 0
    for pair, prompt, response in zip(pairs, prompt_ids, response_ids):
        room = max_length - len(prompt)
        if room < 1:
            dropped += 1
            continue
        target = response + [tokenizer.eos_token_id]
        cut += len(target) > room
        rows.append(TokenizedPair(prompt, target[:room], pair.source))
    if not rows:
        raise DataError(f"{pairs[0].source}: the prompt alone is {len(prompt_ids[0])} tokens, and no pair of the "
                        f"file leaves room for a response within ptx.max_length {max_length}; raise it")
    return Tokenized(rows, cut, dropped)
