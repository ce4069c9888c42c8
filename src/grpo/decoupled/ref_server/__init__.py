"""Reference log-probs over HTTP, so that a large teacher reference model can sit on its own device.

Protocol, version 1 (``PROTOCOL``)::

    POST /v1/logprobs
        headers: Content-Type: application/octet-stream, X-GRPO-Protocol: 1,
                 Authorization: Bearer <token>   (when the server has a token)
        body:    safetensors bytes of exactly
                   prompt_ids      int64       [N, Lp]  left-padded prompts
                   prompt_mask     int64|bool  [N, Lp]  1 for real prompt tokens
                   completion_ids  int64       [N, Lc]  right-padded completions
                   completion_mask int64|bool  [N, Lc]  1 for completion tokens (in a multi-turn row the
                                                        environment's tokens too: they are context, and the
                                                        trainer's loss_mask keeps them out of the KL, so the
                                                        server needs no loss_mask and the protocol stays 1)
                 and optionally the safetensors metadata {"temperature": repr(float)}: the temperature the
                 client expects; the server refuses a request whose temperature is not its own.
        200:     safetensors bytes of {ref_logprobs: float32 [N, Lc]} (padding positions hold finite
                 values that the loss masks out), header X-GRPO-Protocol: 1
    GET /v1/health -> {"protocol": 1, "model": name, "temperature": t, "vocab_size": V, "max_request_bytes": B}

Errors are JSON ``{"error": message, "protocol": 1}``: 400 malformed request (not safetensors, wrong
keys, dtypes or shapes, token ids outside [0, V), mask values other than 0/1, a temperature mismatch),
401 missing or wrong bearer token, 413 body over the size limit (checked on Content-Length and on
the bytes actually received, before parsing), 415 wrong content type, 426 another protocol version
(400 when the header is missing), 500 the forward pass failed.

Only safetensors and JSON cross the wire: nothing is unpickled. Log-probs are computed with
``grpo.step.logprobs.completion_logprobs`` in eval mode under ``torch.no_grad``, one request at a time.

The code: ``protocol`` (request and response bodies, their checks), ``app`` (the FastAPI app and the
server around it), ``client`` (``RefServerClient``).
"""

from grpo.decoupled.ref_server.app import build_app, is_loopback, make_server, run_ref_server
from grpo.decoupled.ref_server.client import BODY_EXCERPT_CHARS, RefServerClient, RefServerError
from grpo.decoupled.ref_server.protocol import (
    CONTENT_TYPE,
    PROTOCOL,
    PROTOCOL_HEADER,
    REQUEST_KEYS,
    RESPONSE_KEY,
    RefProtocolError,
    RefRequest,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)

__all__ = [
    "BODY_EXCERPT_CHARS", "CONTENT_TYPE", "PROTOCOL", "PROTOCOL_HEADER", "REQUEST_KEYS", "RESPONSE_KEY",
    "RefProtocolError", "RefRequest", "RefServerClient", "RefServerError", "build_app", "decode_request",
    "decode_response", "encode_request", "encode_response", "is_loopback", "make_server", "run_ref_server",
]
