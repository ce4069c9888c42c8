"""Reward from a sequence-classification model (``AutoModelForSequenceClassification``), as TRL does it.

Each sample's prompt and completion are joined into one text:
- conversational (the prompt is a list of messages): the tokenizer's chat template applied to
  ``prompt + completion`` messages;
- standard: ``prompt + completion`` string concatenation;
then tokenized without special tokens (the template or the texts carry them) and scored in batches of
``batch_size`` under ``torch.no_grad``. The reward is ``logits[:, 0]`` (the model's first label)
read at the last non-padding token, as a Python float.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpo.data.tags import TagStyle
from grpo.rewards.answers import completion_text
from grpo.rewards.signature import RewardCallable, named


def _default_name(path: str) -> str:
    return "model_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).name or str(path))


def join_prompt_completion(tokenizer: Any, prompt: Any, completion: Any) -> str:
    """One text for the reward model, per the module docstring."""
    if isinstance(prompt, str):
        return prompt + completion_text(completion)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "conversational prompts need a tokenizer with a chat template; this reward model's "
            "tokenizer has none"
        )
    completion_messages = (
        [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
    )
    return tokenizer.apply_chat_template(list(prompt) + completion_messages, tokenize=False)


def make_model_reward(
    tag_style: TagStyle | str | None = None,
    *,
    path: str,
    batch_size: int = 8,
    device: str | None = None,
    dtype: str = "float32",
    max_length: int | None = None,
    name: str | None = None,
) -> RewardCallable:
    """Load a sequence-classification checkpoint and return a reward function scoring with it.

    Args:
        tag_style: unused (accepted so every registry factory has the same call shape).
        path: checkpoint folder (or hub id already in the local cache) holding model and tokenizer.
        batch_size: samples per forward pass; scores do not depend on it.
        device: e.g. "cuda:0"; default "cuda" when available, else "cpu".
        dtype: torch dtype name of the weights, e.g. "float32", "bfloat16".
        max_length: truncate longer texts to this many tokens *from the left*, keeping the end of the
            completion, which is where the score is read; None: no truncation.
        name: the reward's name in logs; default ``model_<folder name>``.
    """
    if batch_size < 1:
        raise ValueError(f"reward model batch_size must be >= 1, got {batch_size}")
    if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
        raise ValueError(f"reward model dtype {dtype!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    # on first use: the reward registry, and so every `import grpo.config`, imports this module
    from transformers.models.auto import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
    return model_reward_from(model, tokenizer, batch_size=batch_size, device=device, max_length=max_length,
                             name=name or _default_name(path))


def model_reward_from(model: Any, tokenizer: Any, *, batch_size: int = 8, device: str | None = None,
                      max_length: int | None = None, name: str) -> RewardCallable:
    """A reward function scoring with a loaded sequence-classification ``model`` and its ``tokenizer`` (the
    Python API's reward models; ``make_model_reward`` loads them from a path): ``logits[:, 0]`` of prompt +
    completion, right-padded."""
    if batch_size < 1:
        raise ValueError(f"reward model batch_size must be >= 1, got {batch_size}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"reward model {name!r}: its tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token  # as TRL does
    if model.config.pad_token_id is None:
        # The classification head finds each row's last real token by this id; without it batch > 1 fails.
        model.config.pad_token_id = tokenizer.pad_token_id
    # Right padding whatever the checkpoint's tokenizer says: with left padding the model numbers
    # positions from the first pad, so a sample's real tokens would sit at positions that depend on
    # the longest sample in its batch. That changes the score of absolute-position models and the
    # floats of rotary ones; a score must not depend on which samples share its batch.
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"

    def model_reward(
        prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        texts = [join_prompt_completion(tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
        rewards: list[float | None] = []
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                inputs = tokenizer(
                    texts[start : start + batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=max_length is not None,
                    max_length=max_length,
                    add_special_tokens=False,
                ).to(device)
                logits = model(**inputs).logits  # [b, num_labels]
                rewards.extend(logits[:, 0].float().cpu().tolist())
        return rewards

    model_reward.per_sample_fallback = False  # type: ignore[attr-defined]  # see reward_function.py
    model_reward.model = model  # type: ignore[attr-defined]  # for tests and device moves
    model_reward.tokenizer = tokenizer  # type: ignore[attr-defined]
    return named(model_reward, name)
