"""``grpo chat``: talk to a trained model with the system prompt it was trained with.

With a prompt, one answer is printed; without, an interactive loop keeps the conversation history
(user and assistant turns, rendered through the tokenizer's chat template every turn).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from grpo.data import render_prompt
from grpo.models.source import load_model_for_inference, resolve_model_source
from grpo.rollout import LeanEngine, RolloutEngine, SamplingParams

EXIT_WORDS = ("exit", "quit")
RESET_WORD = "/reset"


def sampling_params(max_new_tokens: int, temperature: float) -> SamplingParams:
    """Greedy at temperature 0, else plain sampling at ``temperature`` (no top-p/top-k)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        return SamplingParams(n=1, max_tokens=max_new_tokens, greedy=True)
    return SamplingParams(n=1, max_tokens=max_new_tokens, temperature=temperature)


def generate_reply(engine: RolloutEngine, tokenizer, messages: list[dict[str, str]], params: SamplingParams,
                   seed: int | None = None) -> str:
    """The assistant's next turn for a chat (system turn first, last turn the user's)."""
    prompt = render_prompt(tokenizer, messages)
    return engine.generate([prompt], params, seed=seed).completions[0]


def run_chat(
    model_path: str | Path,
    prompt: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    device: str = "auto",
    system_prompt: str | None = None,
    base_model: str | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    input_fn: Callable[[str], str] = input,
) -> list[dict[str, str]]:
    """Answer ``prompt`` once, or chat interactively until EOF or "exit"; returns the conversation.

    system_prompt: None = the run's (config.yaml data.system_prompt, else its task's for its tag style).
    temperature: 0 = greedy. In the loop, "/reset" starts a new conversation. Replies go to stdout,
    everything else to stderr, so ``grpo chat RUN --prompt ...`` can be piped.
    """
    params = sampling_params(max_new_tokens, temperature)
    source = resolve_model_source(model_path, base_model=base_model)
    system_prompt = source.system_prompt if system_prompt is None else system_prompt
    model, tokenizer = load_model_for_inference(source, device, dtype)
    engine = LeanEngine(model, tokenizer)
    if seed is not None:
        torch.manual_seed(seed)
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    if prompt is not None:
        messages = [*system, {"role": "user", "content": prompt}]
        reply = generate_reply(engine, tokenizer, messages, params)
        print(reply)
        return [*messages, {"role": "assistant", "content": reply}]

    print(f"model: {source.describe()}\nsystem prompt: {system_prompt}\n"
          f"(type '{EXIT_WORDS[0]}' or Ctrl-D to leave, '{RESET_WORD}' to start over)", file=sys.stderr)
    messages = list(system)
    while True:
        try:
            text = input_fn("you> ").strip()
        except EOFError:
            print(file=sys.stderr)
            break
        if not text:
            continue
        if text.lower() in EXIT_WORDS:
            break
        if text == RESET_WORD:
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        reply = generate_reply(engine, tokenizer, messages, params)
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return messages
