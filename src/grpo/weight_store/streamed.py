"""A safetensors file written one tensor at a time, for weights gathered from shards one tensor at a time (FSDP2:
``grpo.parallel.fsdp.full_tensors``): the writer never holds more than the tensor in hand, where
``safetensors.torch.save_file`` needs every tensor at once.

The format (safetensors' own): an 8-byte little-endian header length, the JSON header (each tensor's dtype, shape
and byte range in the data, plus ``__metadata__``), padded with spaces to a multiple of 8, then the tensors' bytes
back to back in header order. The header needs every shape before the first byte, so a ``TensorStream`` carries
them (``layout``) beside the tensors; a tensor that arrives out of order or in another shape or dtype is an error
before its bytes are written.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

# safetensors' dtype names
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


@dataclass
class TensorStream:
    """Tensors to write, one at a time: ``layout`` is ``(name, dtype, shape)`` of each in order, ``tensors`` yields
    ``(name, tensor)`` in that order (on the CPU)."""

    layout: list[tuple[str, torch.dtype, tuple[int, ...]]]
    tensors: Iterable[tuple[str, torch.Tensor]]


def _header(stream: TensorStream) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in stream.layout:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        entries[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)


def write_stream(path: Path, stream: TensorStream) -> None:
    """Write ``stream`` to the safetensors file ``path``; ValueError when a tensor does not match its layout entry
    or the stream ends early or runs long (the file is then incomplete: the caller's temporary folder goes)."""
    header = _header(stream)
    expected = iter(stream.layout)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header)))
        out.write(header)
        for name, tensor in stream.tensors:
            want = next(expected, None)
            if want is None or (name, tensor.dtype, tuple(tensor.shape)) != want:
                raise ValueError(f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not match the layout's "
                                 f"next entry {want}")
            out.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    missing = [name for name, _, _ in expected]
    if missing:
        raise ValueError(f"the stream ended before {len(missing)} tensors of its layout, e.g. {missing[:3]}")
