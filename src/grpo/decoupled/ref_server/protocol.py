"""The bodies of the reference server's protocol (described in ``grpo.decoupled.ref_server``): encoding them, and
decoding untrusted bytes, whose header is checked before anything is parsed from it."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes  # parses, never unpickles
from torch import Tensor

PROTOCOL = 1
PROTOCOL_HEADER = "X-GRPO-Protocol"
CONTENT_TYPE = "application/octet-stream"
REQUEST_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
RESPONSE_KEY = "ref_logprobs"
_ID_DTYPES = {"I64"}
_MASK_DTYPES = {"I64", "BOOL"}
_ITEM_BYTES = {"I64": 8, "BOOL": 1}
_MAX_HEADER_BYTES = 64 * 1024  # four tensor entries need a few hundred bytes


class RefProtocolError(ValueError):
    """A request (or response) that does not follow the protocol; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RefRequest:
    """A decoded, validated ``/v1/logprobs`` request.

    prompt_ids, prompt_mask:         [N, Lp] int64, left-padded.
    completion_ids, completion_mask: [N, Lc] int64, right-padded.
    temperature: the temperature the client expects, or None when it did not say.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    temperature: float | None


def encode_request(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                   temperature: float | None = None) -> bytes:
    """The request body: the four tensors as int64 CPU safetensors (+ the expected temperature)."""
    tensors = {name: t.detach().to("cpu", torch.int64).contiguous()
               for name, t in zip(REQUEST_KEYS, (prompt_ids, prompt_mask, completion_ids, completion_mask))}
    _check_shapes({name: tuple(t.shape) for name, t in tensors.items()})
    metadata = None if temperature is None else {"temperature": repr(float(temperature))}
    return safetensors.torch.save(tensors, metadata=metadata)


def decode_request(body: bytes, vocab_size: int) -> RefRequest:
    """Parse and validate a request body; any problem raises ``RefProtocolError`` (status 400).

    The safetensors header is checked first (keys, dtypes, shapes) so that the tensors are only
    materialised for a well-formed request; memory is bounded by ``len(body)``.
    """
    header = _read_header(body)
    metadata = header.pop("__metadata__", None)
    if set(header) != set(REQUEST_KEYS):
        raise RefProtocolError(f"the body must hold exactly the tensors {list(REQUEST_KEYS)}, "
                               f"got {_short(sorted(header))}")
    shapes = {}
    for name in REQUEST_KEYS:
        entry = header[name]
        allowed = _ID_DTYPES if name.endswith("_ids") else _MASK_DTYPES
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(dtype, str) or dtype not in allowed:  # a list would not even hash
            raise RefProtocolError(f"{name}: dtype {_short(dtype)} not allowed (expected {sorted(allowed)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            raise RefProtocolError(f"{name}: shape {_short(shape)} is not a list of ints")
        shapes[name] = tuple(shape)
    _check_shapes(shapes)
    described = sum(_ITEM_BYTES[header[name]["dtype"]] * shapes[name][0] * shapes[name][1] for name in REQUEST_KEYS)
    if described > len(body):  # checked before the parser allocates anything from these numbers
        raise RefProtocolError(f"the body is not safetensors (its header describes {described} bytes of tensors, "
                               f"the body has {len(body)})")
    temperature = _temperature_from(metadata)
    try:
        tensors = load_safetensors_bytes(body)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as err:  # offsets, sizes, buffer errors
        raise RefProtocolError(f"the body is not valid safetensors: {err}") from err
    for name in REQUEST_KEYS:
        tensor = tensors[name]
        if tuple(tensor.shape) != shapes[name]:  # the parser agrees with the header checked above
            raise RefProtocolError(f"{name}: shape {tuple(tensor.shape)} disagrees with its header {shapes[name]}")
        if name.endswith("_mask") and tensor.dtype != torch.bool and not bool(((tensor == 0) | (tensor == 1)).all()):
            raise RefProtocolError(f"{name}: values must be 0 or 1")
    for name in ("prompt_ids", "completion_ids"):
        ids = tensors[name]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise RefProtocolError(f"{name}: token ids must be in [0, {vocab_size}), got min {low}, max {high}")
    return RefRequest(
        prompt_ids=tensors["prompt_ids"], prompt_mask=tensors["prompt_mask"].to(torch.int64),
        completion_ids=tensors["completion_ids"], completion_mask=tensors["completion_mask"].to(torch.int64),
        temperature=temperature,
    )


def _read_header(body: bytes) -> dict[str, Any]:
    """The safetensors JSON header: an 8-byte little-endian length, then that many bytes of JSON."""
    if not isinstance(body, (bytes, bytearray)) or len(body) < 8:
        raise RefProtocolError("the body is not safetensors (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", body[:8])
    if length > min(_MAX_HEADER_BYTES, len(body) - 8):
        raise RefProtocolError(f"the body is not safetensors (header length {length} for a {len(body)}-byte body)")
    try:
        header = json.loads(bytes(body[8:8 + length]).decode("utf-8"))
    except (ValueError, RecursionError) as err:  # bad UTF-8 / JSON, or JSON nested too deep
        raise RefProtocolError(f"the body is not safetensors (header is not JSON: {str(err)[:100]})") from err
    if not isinstance(header, dict):
        raise RefProtocolError("the body is not safetensors (header is not a JSON object)")
    return header


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: error messages quote client input, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_shapes(shapes: dict[str, tuple]) -> None:
    """[N, Lp] prompts and [N, Lc] completions, N, Lp, Lc >= 1 (the first completion token needs a prompt)."""
    for name, shape in shapes.items():
        if len(shape) != 2 or min(shape) < 1:
            raise RefProtocolError(f"{name}: expected a non-empty 2-D [N, L] tensor, got shape {list(shape)}")
    prompt, completion = shapes["prompt_ids"], shapes["completion_ids"]
    if shapes["prompt_mask"] != prompt or shapes["completion_mask"] != completion or prompt[0] != completion[0]:
        raise RefProtocolError("inconsistent shapes: need prompt_ids/prompt_mask [N, Lp] and completion_ids/"
                               f"completion_mask [N, Lc], got { {k: list(v) for k, v in shapes.items()} }")


def _temperature_from(metadata: Any) -> float | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise RefProtocolError("__metadata__ must be a JSON object of strings")
    if "temperature" not in metadata:
        return None
    try:
        return float(metadata["temperature"])
    except ValueError as err:
        raise RefProtocolError(f"__metadata__.temperature {_short(metadata['temperature'])} is not a number") from err


def encode_response(ref_logprobs: Tensor) -> bytes:
    """The response body: {ref_logprobs: float32 [N, Lc]}."""
    return safetensors.torch.save({RESPONSE_KEY: ref_logprobs.detach().to("cpu", torch.float32).contiguous()})


def decode_response(body: bytes, shape: tuple[int, int]) -> Tensor:
    """Parse a response body and check it holds float32 ``ref_logprobs`` of ``shape``; else RefProtocolError."""
    header = _read_header(body)
    header.pop("__metadata__", None)
    entry = header.get(RESPONSE_KEY)
    if set(header) != {RESPONSE_KEY} or not isinstance(entry, dict) or entry.get("dtype") != "F32":
        raise RefProtocolError(f"the response must hold only {RESPONSE_KEY} (float32), got {_short(sorted(header))}")
    if entry.get("shape") != list(shape):
        raise RefProtocolError(f"{RESPONSE_KEY}: shape {_short(entry.get('shape'))} but the request was {list(shape)}")
    try:
        return load_safetensors_bytes(body)[RESPONSE_KEY]
    except (SafetensorError, ValueError, RuntimeError, TypeError) as err:
        raise RefProtocolError(f"the response is not valid safetensors: {err}") from err
