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

The code: ``messages`` (the kinds, ``encode``, ``decode``), ``batch`` (``RolloutBatch`` <-> ``batch``
message), ``packing`` (frames <-> one blob).
"""

from grpo.decoupled.wire.batch import (
    BATCH_TENSORS,
    META_FIELDS,
    OPTIONAL_BATCH_TENSORS,
    batch_to_message,
    message_to_batch,
)
from grpo.decoupled.wire.messages import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_MESSAGE_BYTES,
    FIELD_TYPES,
    KINDS,
    MAX_HEADER_BYTES,
    NUM_FRAMES,
    PROTOCOL_VERSION,
    Message,
    MessageKind,
    WireError,
    decode,
    dumps_json,
    encode,
)
from grpo.decoupled.wire.packing import (
    MAX_PACKED_FRAMES,
    PACK_FORMAT,
    PACK_MAGIC,
    pack_bytes,
    unpack_bytes,
)

__all__ = [
    "ALLOWED_DTYPES", "BATCH_TENSORS", "DEFAULT_MAX_MESSAGE_BYTES", "FIELD_TYPES", "KINDS", "MAX_HEADER_BYTES",
    "MAX_PACKED_FRAMES", "META_FIELDS", "NUM_FRAMES", "OPTIONAL_BATCH_TENSORS", "PACK_FORMAT", "PACK_MAGIC",
    "PROTOCOL_VERSION", "Message", "MessageKind", "WireError", "batch_to_message", "decode", "dumps_json",
    "encode", "message_to_batch", "pack_bytes", "unpack_bytes",
]
