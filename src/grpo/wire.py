"""The wire format between samplers and the trainer: pure functions, no sockets, never pickle.

A message is three frames::

    [token, header, payload]

token    the shared secret as UTF-8 bytes (empty when none is configured); compared in constant time.
header   a UTF-8 JSON object ``{"v": PROTOCOL_VERSION, "kind": KIND, ...fields}``; the fields each
         kind requires, and their types, are listed in ``KINDS``.
payload  ``safetensors`` bytes of the message's tensors, or empty. Only ``batch`` carries tensors.

``decode`` checks, in this order and before parsing anything it has not size-checked: the frame
count, the total size, the token, the header size, the JSON, the version, the kind, the fields, the
payload, and the tensor dtypes. Every rejection is a ``WireError`` whose message says what was wrong;
no other exception escapes ``decode`` (a fuzz test holds it to that).

``batch_to_message`` / ``message_to_batch`` map a ``RolloutBatch`` to a ``batch`` message and back,
exactly (``torch.equal`` on every tensor, dtypes kept). ``pack_bytes`` / ``unpack_bytes`` turn a
message's frames into one length-prefixed blob (e.g. for a ``torch.distributed`` broadcast between
trainer ranks) and back.
"""

from __future__ import annotations

import hmac
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from grpo.records import Generation, RolloutBatch

PROTOCOL_VERSION = 1

# The header holds a batch's texts (prompts, completions, dataset columns), so it is allowed to be
# larger than a control message needs: a 1 MiB cap would refuse a batch of 512 completions of 1k
# tokens. It is still bounded so that JSON parsing of an untrusted header stays cheap.
MAX_HEADER_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
NUM_FRAMES = 3

ALLOWED_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})


class WireError(ValueError):
    """A message that cannot be encoded or that a receiver must reject; the text says why.

    ``header`` is the parsed header when the message got as far as an authenticated, well-formed JSON
    header (so a receiver can name the batch it rejects), else None.
    """

    def __init__(self, message: str, header: dict | None = None):
        super().__init__(message)
        self.header = header


# ---------------------------------------------------------------------------------------------------
# Message kinds
# ---------------------------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


FIELD_TYPES: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "number": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "str|null": lambda v: v is None or isinstance(v, str),
    "int|null": lambda v: v is None or _is_int(v),
}


@dataclass(frozen=True)
class MessageKind:
    """One kind of message: its direction, the header fields it must (and may) carry, with their types."""

    name: str
    direction: str
    required: dict[str, str]
    optional: dict[str, str] = field(default_factory=dict)
    carries_tensors: bool = False


KINDS: dict[str, MessageKind] = {k.name: k for k in (
    MessageKind("hello", "sampler -> trainer", {"sampler_id": "str", "incarnation": "int"}),
    MessageKind("welcome", "trainer -> sampler",
                {"policy_version": "int", "trained_count": "int", "pending_count": "int", "protocol": "int",
                 "trainer_id": "str", "max_message_bytes": "int"},
                {"weights_path": "str|null"}),
    MessageKind("batch", "sampler -> trainer",
                {"batch_id": "str", "sampler_id": "str", "policy_version": "int", "completions": "list[str]",
                 "prompts": "list[str]", "reward_names": "list[str]", "columns": "object", "meta": "object"},
                carries_tensors=True),
    MessageKind("ack", "trainer -> sampler", {"batch_id": "str", "policy_version": "int"},
                {"weights_version": "int|null", "weights_path": "str|null"}),
    MessageKind("dropped", "trainer -> sampler", {"batch_id": "str", "reason": "str", "policy_version": "int"}),
    MessageKind("busy", "trainer -> sampler", {"batch_id": "str", "queue_depth": "int"}),
    MessageKind("weights", "trainer -> sampler", {"version": "int", "path": "str"}),
    MessageKind("heartbeat", "both", {}, {"time": "number", "policy_version": "int", "trainer_id": "str"}),
    MessageKind("bye", "both", {}, {"reason": "str"}),
    MessageKind("error", "trainer -> sampler", {"reason": "str"}, {"code": "str", "batch_id": "str|null"}),
)}


@dataclass(frozen=True)
class Message:
    """A decoded message. ``header`` holds the kind's fields (without ``v`` and ``kind``)."""

    kind: str
    header: dict
    tensors: dict[str, Tensor]


def _check_fields(kind: MessageKind, header: Mapping) -> None:
    for name, type_name in kind.required.items():
        if name not in header:
            raise WireError(f"{kind.name} message is missing the field {name!r} ({type_name})")
    for name, type_name in {**kind.required, **kind.optional}.items():
        if name in header and not FIELD_TYPES[type_name](header[name]):
            raise WireError(f"{kind.name} field {name!r} must be {type_name}, got {type(header[name]).__name__}")


def _kind(name: Any) -> MessageKind:
    if not isinstance(name, str) or name not in KINDS:
        raise WireError(f"unknown message kind {str(name)[:64]!r}; known: {', '.join(sorted(KINDS))}")
    return KINDS[name]


def _check_dtypes(tensors: Mapping[str, Tensor]) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype not in ALLOWED_DTYPES:
            raise WireError(f"tensor {name[:64]!r} has dtype {tensor.dtype}, which the wire format does not carry "
                            f"(allowed: {', '.join(sorted(str(d) for d in ALLOWED_DTYPES))})")


# ---------------------------------------------------------------------------------------------------
# encode / decode
# ---------------------------------------------------------------------------------------------------

def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def dumps_json(obj: Any) -> bytes:
    """Strict JSON bytes (no NaN/Infinity), the header encoding. Raises WireError for non-JSON values."""
    try:
        return json.dumps(obj, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise WireError(f"header is not strict JSON: {exc}") from exc


def encode(kind: str, header: Mapping[str, Any], tensors: Mapping[str, Tensor] | None = None,
           token: str = "") -> list[bytes]:
    """Frames ``[token, header_json, payload]`` of one message, checked as ``decode`` would check them.

    Tensors are copied to contiguous CPU memory; they must have an allowed dtype.
    """
    spec = _kind(kind)
    if not isinstance(header, Mapping):
        raise WireError(f"header must be a mapping, got {type(header).__name__}")
    for reserved in ("v", "kind"):
        if reserved in header:
            raise WireError(f"header field {reserved!r} is reserved for the envelope")
    _check_fields(spec, header)
    header_bytes = dumps_json({"v": PROTOCOL_VERSION, "kind": kind, **header})
    payload = b""
    if tensors:
        if not spec.carries_tensors:
            raise WireError(f"{kind} messages carry no tensors")
        _check_dtypes(tensors)
        # clone: safetensors needs contiguous, CPU tensors; the copy also detaches us from the caller's buffers.
        payload = safetensors.torch.save({name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
                                          for name, t in tensors.items()})
    return [token.encode("utf-8"), header_bytes, payload]


def _frame_bytes(frame: Any, index: int) -> bytes:
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, (bytearray, memoryview)):
        return bytes(frame)
    raise WireError(f"frame {index} is {type(frame).__name__}, not bytes")


def _frame_len(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def decode(frames: Sequence[Any], *, token: str = "", max_bytes: int,
           max_header_bytes: int = MAX_HEADER_BYTES) -> Message:
    """Check and parse the frames of one message. Raises WireError (only) if it must be rejected."""
    if not isinstance(frames, (list, tuple)):
        raise WireError(f"a message is a list of frames, got {type(frames).__name__}")
    if len(frames) != NUM_FRAMES:
        raise WireError(f"a message has {NUM_FRAMES} frames (token, header, payload), got {len(frames)}")
    for index, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise WireError(f"frame {index} is {type(frame).__name__}, not bytes")
    total = sum(_frame_len(f) for f in frames)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes} bytes")
    token_frame, header_frame, payload = (_frame_bytes(f, i) for i, f in enumerate(frames))

    if not hmac.compare_digest(token_frame, token.encode("utf-8")):
        raise WireError("token mismatch: the message does not carry this endpoint's shared token")

    if len(header_frame) > max_header_bytes:
        raise WireError(f"header of {len(header_frame)} bytes exceeds the limit of {max_header_bytes} bytes")
    try:
        header = json.loads(header_frame.decode("utf-8"), parse_constant=_reject_constant,
                            object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise WireError(f"header is not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(header, dict):
        raise WireError(f"header must be a JSON object, got {type(header).__name__}")

    version = header.pop("v", None)
    if not _is_int(version):
        raise WireError("header has no integer protocol version 'v'")
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version} is not this endpoint's version {PROTOCOL_VERSION}")
    spec = _kind(header.pop("kind", None))
    try:
        _check_fields(spec, header)
    except WireError as exc:
        raise WireError(str(exc), header) from None

    tensors: dict[str, Tensor] = {}
    if payload:
        if not spec.carries_tensors:
            raise WireError(f"{spec.name} messages carry no tensors, got a {len(payload)}-byte payload", header)
        try:
            tensors = safetensors.torch.load(payload)
        # safetensors raises SafetensorError for most bad input but KeyError for an unknown dtype name
        # and other errors for other corruptions; whatever it raises, untrusted bytes are rejected.
        except Exception as exc:
            raise WireError(f"payload is not valid safetensors: {str(exc)[:200]}", header) from exc
        try:
            _check_dtypes(tensors)
        except WireError as exc:
            raise WireError(str(exc), header) from None
    return Message(spec.name, header, tensors)


# ---------------------------------------------------------------------------------------------------
# RolloutBatch <-> batch message
# ---------------------------------------------------------------------------------------------------

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
}
OPTIONAL_BATCH_TENSORS = ("old_logprobs", "ref_logprobs")
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
    if batch.old_logprobs is not None:
        tensors["old_logprobs"] = batch.old_logprobs
    if batch.ref_logprobs is not None:
        tensors["ref_logprobs"] = batch.ref_logprobs
    header = {
        **{name: meta[name] for name in META_FIELDS},
        "meta": {k: v for k, v in meta.items() if k not in META_FIELDS},
        "completions": list(gen.completions), "prompts": list(batch.prompts),
        "reward_names": list(batch.reward_names), "columns": {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in batch.columns.items()},
    }
    _check_fields(KINDS["batch"], header)
    _check_batch(tensors, header["completions"], header["prompts"], header["reward_names"], header["columns"])
    return header, tensors


def message_to_batch(message: Message) -> tuple[RolloutBatch, dict]:
    """The rollout batch of a decoded ``batch`` message and its meta (batch_id, sampler_id,
    policy_version and the sender's other keys). Raises WireError when shapes or texts disagree."""
    if message.kind != "batch":
        raise WireError(f"expected a batch message, got {message.kind}")
    header, tensors = message.header, message.tensors
    try:
        _check_batch(tensors, header["completions"], header["prompts"], header["reward_names"], header["columns"])
    except WireError as exc:
        raise WireError(str(exc), header) from None
    batch = RolloutBatch(
        generation=Generation(
            prompt_ids=tensors["prompt_ids"], prompt_mask=tensors["prompt_mask"],
            completion_ids=tensors["completion_ids"], completion_mask=tensors["completion_mask"],
            truncated=tensors["truncated"], completions=list(header["completions"])),
        rewards=tensors["rewards"], reward_parts=tensors["reward_parts"], reward_names=list(header["reward_names"]),
        advantages=tensors["advantages"], old_logprobs=tensors.get("old_logprobs"),
        ref_logprobs=tensors.get("ref_logprobs"), prompts=list(header["prompts"]), columns=dict(header["columns"]))
    meta = {**header["meta"], **{name: header[name] for name in META_FIELDS}}
    return batch, meta


# ---------------------------------------------------------------------------------------------------
# One blob per message
# ---------------------------------------------------------------------------------------------------

PACK_MAGIC = b"GRPW"
PACK_FORMAT = 1
MAX_PACKED_FRAMES = 16
_PACK_PREFIX = struct.Struct("<4sBI")  # magic, format, frame count
_PACK_LENGTH = struct.Struct("<Q")


def pack_bytes(frames: Sequence[bytes]) -> bytes:
    """One blob: ``b"GRPW"``, format byte, u32 frame count, a u64 length per frame (little-endian), the frames."""
    if len(frames) > MAX_PACKED_FRAMES:
        raise WireError(f"cannot pack {len(frames)} frames (at most {MAX_PACKED_FRAMES})")
    parts = [_PACK_PREFIX.pack(PACK_MAGIC, PACK_FORMAT, len(frames))]
    parts += [_PACK_LENGTH.pack(_frame_len(f)) for f in frames]
    parts += [_frame_bytes(f, i) for i, f in enumerate(frames)]
    return b"".join(parts)


def unpack_bytes(data: bytes | bytearray | memoryview) -> list[bytes]:
    """The frames of a ``pack_bytes`` blob. Raises WireError unless the lengths account for every byte."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"packed message must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _PACK_PREFIX.size:
        raise WireError(f"packed message of {len(data)} bytes is shorter than its {_PACK_PREFIX.size}-byte prefix")
    magic, fmt, count = _PACK_PREFIX.unpack_from(data, 0)
    if magic != PACK_MAGIC:
        raise WireError(f"packed message starts with {magic!r}, not {PACK_MAGIC!r}")
    if fmt != PACK_FORMAT:
        raise WireError(f"packed message format {fmt} is not {PACK_FORMAT}")
    if count > MAX_PACKED_FRAMES:
        raise WireError(f"packed message claims {count} frames (at most {MAX_PACKED_FRAMES})")
    offset = _PACK_PREFIX.size + count * _PACK_LENGTH.size
    if len(data) < offset:
        raise WireError(f"packed message of {len(data)} bytes is too short for {count} frame lengths")
    lengths = [_PACK_LENGTH.unpack_from(data, _PACK_PREFIX.size + i * _PACK_LENGTH.size)[0] for i in range(count)]
    if offset + sum(lengths) != len(data):
        raise WireError(f"packed frame lengths add up to {sum(lengths)} bytes but {len(data) - offset} follow")
    frames = []
    for length in lengths:
        frames.append(data[offset:offset + length])
        offset += length
    return frames
