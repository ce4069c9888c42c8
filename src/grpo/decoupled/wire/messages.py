"""Messages of the wire format (described in ``grpo.decoupled.wire``): the kinds and their header fields, ``encode``,
and ``decode``, which checks untrusted frames before parsing them and raises only ``WireError``."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
from safetensors.torch import load as load_safetensors_bytes  # parses, never unpickles
from torch import Tensor

# 2: samplers ask for work (want / work): a chunk of a step each. 3: a batch carries multi-turn rows
# (loss_mask, messages, rollout_metrics): a version-2 trainer would train on environment tokens. 4: a batch
# carries each token's policy version (token_versions): a version-3 trainer would judge staleness per chunk.
# 5: work carries ``adopt`` (a dead sampler's unsent partial-rollout groups): a version-4 sampler would drop them.
# 6: a batch carries an MoE policy's recorded routing (``routing``): a version-5 trainer would refuse the tensor.
PROTOCOL_VERSION = 6

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
    "list|null": lambda v: v is None or isinstance(v, list),
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
    MessageKind("hello", "sampler -> trainer", {"sampler_id": "str", "incarnation": "int"},
                {"config_hash": "str", "host": "str"}),
    MessageKind("welcome", "trainer -> sampler",
                {"policy_version": "int", "trained_count": "int", "pending_count": "int", "protocol": "int",
                 "trainer_id": "str", "max_message_bytes": "int"},
                {"weights_path": "str|null"}),
    MessageKind("batch", "sampler -> trainer",
                {"batch_id": "str", "sampler_id": "str", "policy_version": "int", "completions": "list[str]",
                 "prompts": "list[str]", "reward_names": "list[str]", "columns": "object", "meta": "object"},
                {"reward_metrics": "object", "reward_extras": "object", "messages": "list|null",
                 "rollout_metrics": "object"}, carries_tensors=True),
    # durable false: trained, but the checkpoint that lists it is not on disk yet; the sampler frees
    # the slot and keeps the batch to resend should the trainer restart (a durable ack follows).
    MessageKind("ack", "trainer -> sampler", {"batch_id": "str", "policy_version": "int"},
                {"weights_version": "int|null", "weights_path": "str|null", "durable": "bool"}),
    MessageKind("dropped", "trainer -> sampler", {"batch_id": "str", "reason": "str", "policy_version": "int"}),
    MessageKind("busy", "trainer -> sampler", {"batch_id": "str", "queue_depth": "int"}),
    MessageKind("weights", "trainer -> sampler", {"version": "int", "path": "str"}),
    # A sampler asks for a chunk to make (again every few seconds while it waits: asking twice is safe);
    # the trainer answers with work as soon as a chunk is open (grpo.decoupled.work_plan).
    MessageKind("want", "sampler -> trainer", {}),
    MessageKind("work", "trainer -> sampler", {"batch_id": "str", "step": "int", "rank": "int", "min_version": "int",
                                               "adopt": "list[str]"}),
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


def _peer_name(header: Mapping) -> str:
    """Who sent a header, for refusing it by name: its sampler or trainer id, when it carries a string one."""
    for field_name in ("sampler_id", "trainer_id"):
        if isinstance(header.get(field_name), str):
            return f"{field_name.split('_')[0]} {header[field_name][:64]!r}"
    return "a peer"


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
        raise WireError(f"{_peer_name(header)} speaks protocol version {version}, not this endpoint's version "
                        f"{PROTOCOL_VERSION}: samplers and the trainer must run the same grpo release")
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
            tensors = load_safetensors_bytes(payload)
        # safetensors raises SafetensorError for most bad input but KeyError for an unknown dtype name
        # and other errors for other corruptions; whatever it raises, untrusted bytes are rejected.
        except Exception as exc:
            raise WireError(f"payload is not valid safetensors: {str(exc)[:200]}", header) from exc
        try:
            _check_dtypes(tensors)
        except WireError as exc:
            raise WireError(str(exc), header) from None
    return Message(spec.name, header, tensors)
