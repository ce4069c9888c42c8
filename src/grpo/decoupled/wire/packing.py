"""A message's frames as one length-prefixed blob and back (e.g. for a ``torch.distributed`` broadcast
between trainer ranks)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from grpo.decoupled.wire.messages import WireError, _frame_bytes, _frame_len

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
