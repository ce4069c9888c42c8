"""A ``RolloutBatch`` as a ``batch`` message and back, exactly (``torch.equal`` on every tensor, dtypes
kept), with the names, dtypes and shapes of its tensors checked on both ways."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo.decoupled.wire.messages import FIELD_TYPES, KINDS, Message, WireError, _check_fields
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch

# name -> (what the dtype must be, accepted dtypes, dims); dims name N (rows), Lp, Lc, F (reward functions)
_INTEGER = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
BATCH_TENSORS: dict[str, tuple[str, frozenset, tuple[str, ...]]] = {
    "prompt_ids": ("integer", _INTEGER, ("N", "Lp")),
    "prompt_mask": ("integer or bool", _INTEGER | {torch.bool}, ("N", "Lp")),
    "completion_ids": ("integer", _INTEGER, ("N", "Lc")),
    "completion_mask": ("integer or bool", _INTEGER | {torch.bool}, ("N", "Lc")),
    "truncated": ("bool", frozenset({torch.bool}), ("N",)),
    "rewards": ("floating", _FLOAT, ("N",)),
    "reward_parts": ("floating", _FLOAT, ("N", "F")),
    "advantages": ("floating", _FLOAT, ("N",)),
    "old_logprobs": ("floating", _FLOAT, ("N", "Lc")),
    "ref_logprobs": ("floating", _FLOAT, ("N", "Lc")),
    "sampler_logprobs": ("floating", _FLOAT, ("N", "Lc")),  # for loss.sampler_is_correction
    "loss_mask": ("integer or bool", _INTEGER | {torch.bool}, ("N", "Lc")),  # multi-turn: the sampled tokens
    "token_versions": ("integer", _INTEGER, ("N", "Lc")),  # the policy version that sampled each token
    # an MoE policy's recorded experts per prompt and completion position (routing replay); T = Lp + Lc
    "routing": ("integer", _INTEGER, ("N", "T", "R", "K")),
}
OPTIONAL_BATCH_TENSORS = ("old_logprobs", "ref_logprobs", "sampler_logprobs", "loss_mask", "token_versions", "routing")
# on the batch's Generation, not the RolloutBatch
_GENERATION_TENSORS = ("loss_mask", "token_versions", "routing")
META_FIELDS = {"batch_id": "str", "sampler_id": "str", "policy_version": "int"}


def _check_batch(tensors: Mapping[str, Tensor], completions: list, prompts: list, reward_names: list,
                 columns: Mapping[str, Any]) -> None:
    """Names, dtypes and consistent shapes of a batch's tensors and texts; WireError says what differs."""
    missing = [n for n in BATCH_TENSORS if n not in tensors and n not in OPTIONAL_BATCH_TENSORS]
    if missing:
        raise WireError(f"batch is missing tensors {missing}")
    unknown = sorted(set(tensors) - set(BATCH_TENSORS))
    if unknown:
        raise WireError(f"batch has unknown tensors {[u[:64] for u in unknown[:8]]}; known: {list(BATCH_TENSORS)}")
    dims: dict[str, int] = {"F": len(reward_names)}
    for name, (dtype_name, dtypes, dim_names) in BATCH_TENSORS.items():
        if name not in tensors:
            continue
        tensor = tensors[name]
        if not isinstance(tensor, Tensor):
            raise WireError(f"batch field {name} must be a tensor, got {type(tensor).__name__}")
        if tensor.dtype not in dtypes:
            raise WireError(f"batch tensor {name} must be {dtype_name}, got {tensor.dtype}")
        if tensor.dim() != len(dim_names):
            raise WireError(f"batch tensor {name} must be [{', '.join(dim_names)}], got shape {list(tensor.shape)}")
        for dim_name, size in zip(dim_names, tensor.shape):
            expected = dims.setdefault(dim_name, size)
            if size != expected:
                raise WireError(f"batch tensor {name} has shape {list(tensor.shape)}: {dim_name} is {size} here "
                                f"but {expected} elsewhere (reward_names gives F)")
    if "loss_mask" in tensors and bool((tensors["loss_mask"].long() > tensors["completion_mask"].long()).any()):
        raise WireError("batch tensor loss_mask is 1 where completion_mask is 0: a sampled token must be a "
                        "completion token")
    if "token_versions" in tensors and bool((tensors["token_versions"].long() < 0).any()):
        raise WireError("batch tensor token_versions holds a negative policy version")
    if "routing" in tensors:
        routing, T = tensors["routing"], dims.get("Lp", 0) + dims.get("Lc", 0)
        if routing.shape[1] != T:
            raise WireError(f"batch tensor routing has {routing.shape[1]} positions per row, not Lp + Lc = {T}")
        if routing.numel() and int(routing.min()) < -1:
            raise WireError("batch tensor routing holds an expert index below -1 (-1: a position not recorded)")
    n = dims["N"]
    if len(completions) != n:
        raise WireError(f"batch has {len(completions)} completion texts for N={n} rows")
    if n % max(len(prompts), 1) != 0 or (n > 0) != (len(prompts) > 0):
        raise WireError(f"batch has {len(prompts)} prompts for N={n} rows (one prompt per group of G rows)")
    for key, values in columns.items():
        if not isinstance(key, str):
            raise WireError(f"batch column names must be strings, got {key!r}")
        if not isinstance(values, list) or len(values) != n:
            size = len(values) if isinstance(values, list) else type(values).__name__
            raise WireError(f"batch column {key[:64]!r} must be a list of N={n} values, got {size}")


def _check_reward_logs(header: Mapping[str, Any], n: int) -> None:
    """What rewards and the multi-turn driver logged (optional fields): metrics are name -> number, extras
    name -> N values, messages N lists of message objects (or null: single-turn)."""
    for field_name in ("reward_metrics", "rollout_metrics"):
        for name, value in header.get(field_name, {}).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise WireError(f"batch {field_name}[{name[:64]!r}] must be a number, got {type(value).__name__}")
    for name, values in header.get("reward_extras", {}).items():
        if not isinstance(values, list) or len(values) != n:
            raise WireError(f"batch reward_extras[{name[:64]!r}] must be a list of N={n} values")
    messages = header.get("messages")
    if messages is not None and not (isinstance(messages, list) and len(messages) == n and all(
            isinstance(row, list) and all(isinstance(m, dict) for m in row) for row in messages)):
        raise WireError(f"batch messages must be null or a list of N={n} lists of message objects")


def batch_to_message(batch: RolloutBatch, meta: Mapping[str, Any]) -> tuple[dict, dict[str, Tensor]]:
    """The ``batch`` header and tensors of a rollout batch.

    ``meta`` must hold ``batch_id`` (str), ``sampler_id`` (str) and ``policy_version`` (int: the weights
    the batch was sampled with); any other keys (JSON values) travel in ``header["meta"]``.
    """
    for name, type_name in META_FIELDS.items():
        if name not in meta or not FIELD_TYPES[type_name](meta[name]):
            raise WireError(f"batch meta needs {name!r} ({type_name}), got {meta.get(name)!r}")
    if not all(isinstance(key, str) for key in meta):
        raise WireError(f"batch meta keys must be strings, got {sorted(map(repr, meta))}")
    gen = batch.generation
    tensors = {
        "prompt_ids": gen.prompt_ids, "prompt_mask": gen.prompt_mask,
        "completion_ids": gen.completion_ids, "completion_mask": gen.completion_mask, "truncated": gen.truncated,
        "rewards": batch.rewards, "reward_parts": batch.reward_parts, "advantages": batch.advantages,
    }
    for name in OPTIONAL_BATCH_TENSORS:
        value = getattr(gen if name in _GENERATION_TENSORS else batch, name)
        if value is not None:  # absent on the wire: None again on the other side
            tensors[name] = value
    header = {
        **{name: meta[name] for name in META_FIELDS},
        "meta": {k: v for k, v in meta.items() if k not in META_FIELDS},
        "completions": list(gen.completions), "prompts": list(batch.prompts),
        "reward_names": list(batch.reward_names),
        "columns": {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in batch.columns.items()},
        "reward_metrics": dict(batch.reward_metrics),
        "reward_extras": {k: list(v) for k, v in batch.reward_extras.items()},
        "messages": gen.messages, "rollout_metrics": dict(gen.rollout_metrics),
    }
    _check_fields(KINDS["batch"], header)
    _check_batch(tensors, header["completions"], header["prompts"], header["reward_names"], header["columns"])
    _check_reward_logs(header, len(header["completions"]))
    return header, tensors


def message_to_batch(message: Message) -> tuple[RolloutBatch, dict]:
    """The rollout batch of a decoded ``batch`` message and its meta (batch_id, sampler_id,
    policy_version and the sender's other keys). Raises WireError when shapes or texts disagree."""
    if message.kind != "batch":
        raise WireError(f"expected a batch message, got {message.kind}")
    header, tensors = message.header, message.tensors
    try:
        _check_batch(tensors, header["completions"], header["prompts"], header["reward_names"], header["columns"])
        _check_reward_logs(header, len(header["completions"]))
    except WireError as exc:
        raise WireError(str(exc), header) from None
    batch = RolloutBatch(
        generation=Generation(
            prompt_ids=tensors["prompt_ids"], prompt_mask=tensors["prompt_mask"],
            completion_ids=tensors["completion_ids"], completion_mask=tensors["completion_mask"],
            truncated=tensors["truncated"], completions=list(header["completions"]),
            loss_mask=tensors.get("loss_mask"), token_versions=tensors.get("token_versions"),
            routing=tensors.get("routing"),
            messages=header.get("messages"),
            rollout_metrics=dict(header.get("rollout_metrics", {}))),
        rewards=tensors["rewards"], reward_parts=tensors["reward_parts"], reward_names=list(header["reward_names"]),
        advantages=tensors["advantages"], old_logprobs=tensors.get("old_logprobs"),
        ref_logprobs=tensors.get("ref_logprobs"), sampler_logprobs=tensors.get("sampler_logprobs"),
        prompts=list(header["prompts"]), columns=dict(header["columns"]),
        reward_metrics=dict(header.get("reward_metrics", {})), reward_extras=dict(header.get("reward_extras", {})))
    meta = {**header["meta"], **{name: header[name] for name in META_FIELDS}}
    return batch, meta
