"""Full model weights from the trainer's rank 0 to the samplers over a process group of their own
(``decoupled.weight_sync: broadcast``), instead of through files.

The group: rank 0 (the trainer's rank 0) hosts a ``torch.distributed.TCPStore`` at ``host:port``; sampler
k joins as group rank k + 1, so the group has ``num_samplers + 1`` members. It is independent of the trainer
ranks' default group (a ``ProcessGroupGloo`` built from the store directly, registered nowhere), so the
other trainer ranks take no part. Gloo on CPU; the backend is a parameter (NCCL has the same shape: one
group, broadcasts from rank 0, buffers on the GPU).

One version on the wire: an int64 header length (-1: the sender closed the group), the header (JSON:
version, and each tensor's name, dtype, shape and byte count, in order), then the tensors' bytes packed
into flat uint8 buckets of at most ``bucket_bytes`` (a bigger tensor is a bucket of its own). Bytes, not
typed buffers: every dtype travels bit for bit and tensors of mixed dtypes share a bucket, so a small
model is three collectives. The receiver rebuilds each tensor with its dtype and shape, as
``WeightStore.load`` would give it.

Limits (the caller falls back to files, ``grpo.decoupled.weight_sync``):
- the group forms once: every member must join within ``join_timeout_s``; a sampler that starts later (a
  restarted one) cannot join, and a member that dies breaks the group for good (gloo raises on rank 0's
  next send when the connection was reset; a member alive but stuck stalls it until ``op_timeout_s``);
- gloo connects every pair of members, so samplers on different hosts must reach each other too
  (``GLOO_SOCKET_IFNAME`` picks the interface);
- authentication: with the run's shared token (``decoupled.token_env``) every key of the group in the store is
  named after an HMAC of the token, so a process without it finds no member to connect to and is never given
  a rank: it gets nothing and its join times out. Without a token the store listens on 127.0.0.1 only (every
  role is then on this machine: a link beyond loopback needs the token). The bytes themselves are not
  encrypted: keep ``decoupled.weight_sync_port`` inside the cluster's network (what arrives is only parsed as
  JSON and raw bytes, never unpickled);
- full weights only: a LoRA adapter goes through files with its config.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import socket

import numpy as np
import torch
import torch.distributed as dist

HEADER_FORMAT = "grpo-weight-broadcast-1"
CLOSED = -1  # a header length that says the sender closed the group


class BroadcastError(RuntimeError):
    """The group could not form, or a collective failed (a member died, a timeout): use files instead."""


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def _dtype(name: str) -> torch.dtype:
    """``torch.float32`` for ``"torch.float32"``; only real dtypes (the header names no arbitrary attribute)."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise BroadcastError(f"weight broadcast header names an unknown dtype {name!r}")
    return value


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's bytes as a flat uint8 tensor ([nbytes]); a 0-dim tensor is flattened first."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


# The bytes are moved with numpy: one plain memcpy per tensor. torch's copies of many small tensors each
# start a thread pool region, which cost ~4 ms apiece on a busy 2-core machine (0.4 s for a 100-tensor model).


def pack_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[dict, list[torch.Tensor]]:
    """``(header, buckets)``: the header describes every tensor in order, each bucket is a flat uint8
    tensor holding consecutive tensors' bytes, at most ``bucket_bytes`` unless one tensor is bigger."""
    entries, buckets, current, current_size = [], [], [], 0
    for name, tensor in state_dict.items():
        data = tensor_bytes(tensor).numpy()
        entries.append([name, str(tensor.dtype), list(tensor.shape), data.size])
        if current and current_size + data.size > bucket_bytes:
            buckets.append(torch.from_numpy(np.concatenate(current)))
            current, current_size = [], 0
        current.append(data)
        current_size += data.size
    if current:
        buckets.append(torch.from_numpy(np.concatenate(current)))
    header = {"format": HEADER_FORMAT, "tensors": entries, "buckets": [b.numel() for b in buckets]}
    return header, buckets


def unpack_buckets(header: dict, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict ``pack_buckets`` packed: each tensor with its dtype and shape, in its own storage."""
    flat = np.concatenate([b.numpy() for b in buckets]) if buckets else np.empty(0, np.uint8)  # [total bytes]
    state, offset = {}, 0
    for name, dtype, shape, nbytes in header["tensors"]:
        # A copy per tensor: its own aligned storage (a view at an odd offset cannot change dtype, and
        # tensors sharing one storage could not be saved to safetensors by an engine).
        if nbytes == 0:  # numpy gives an empty slice stride 0, which torch cannot view as a wider dtype
            state[name] = torch.empty(shape, dtype=_dtype(dtype))
        else:
            state[name] = torch.from_numpy(flat[offset:offset + nbytes].copy()).view(_dtype(dtype)).reshape(shape)
        offset += nbytes
    if offset != flat.size:
        raise BroadcastError(f"weight broadcast: the header accounts for {offset} bytes, {flat.size} arrived")
    return state


class WeightBroadcast:
    """One member of the weights group: rank 0 sends versions, every other rank receives them.

    Args:
        host, port: where rank 0's TCPStore listens (rank 0 binds every interface at ``port``).
        rank, size: this member's group rank and the group's size (num_samplers + 1).
        join_timeout_s: how long forming the group may take (every member must have joined by then).
        op_timeout_s: how long rank 0 waits for one collective; receivers wait this long for a version's
            tensors once its header came, and ``wait_timeout_s`` for the next header (the trainer's step).
        backend: "gloo" (CPU buffers) or "nccl" (buffers on ``torch.cuda.current_device()``).
        token: the run's shared token (None: no authentication, and rank 0's store listens on loopback only).
    Raises BroadcastError when the group does not form in time.
    """

    def __init__(self, host: str, port: int, rank: int, size: int, *, join_timeout_s: float,
                 op_timeout_s: float, wait_timeout_s: float = 7 * 24 * 3600.0, backend: str = "gloo",
                 bucket_bytes: int = 256 << 20, token: str | None = None) -> None:
        self.rank, self.size, self.backend, self.bucket_bytes = rank, size, backend, bucket_bytes
        self.op_timeout_s, self.wait_timeout_s = op_timeout_s, wait_timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        listener = _loopback_listener(port) if rank == 0 and token is None else None
        try:
            self.store = dist.TCPStore(host, port, world_size=None, is_master=rank == 0,
                                       timeout=_seconds(join_timeout_s), wait_for_workers=False,
                                       **({"master_listen_fd": listener.fileno()} if listener else {}))
            self.group = _make_group(backend, dist.PrefixStore(group_prefix(token), self.store), rank, size,
                                     _seconds(join_timeout_s))
        except (RuntimeError, ValueError) as exc:  # DistStoreError and gloo's timeouts are RuntimeErrors
            raise BroadcastError(f"weight broadcast group at {host}:{port} (rank {rank} of {size}) did not form "
                                 f"within {join_timeout_s:.0f} s: {exc}") from exc

    def _broadcast(self, tensor: torch.Tensor, timeout_s: float) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor, options.timeout = 0, 0, _seconds(timeout_s)
        tensor = tensor.to(self.device)
        try:
            self.group.broadcast([tensor], options).wait()
        except RuntimeError as exc:  # gloo: connection reset by a dead member, or a timeout
            raise BroadcastError(f"weight broadcast (rank {self.rank} of {self.size}) failed: {exc}") from exc
        return tensor

    def send(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Rank 0: version ``version`` to every member. BroadcastError when one of them is gone."""
        header, buckets = pack_buckets(state_dict, self.bucket_bytes)
        header["version"] = version
        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.long), self.op_timeout_s)
        self._broadcast(data, self.op_timeout_s)
        for bucket in buckets:
            self._broadcast(bucket, self.op_timeout_s)

    def receive(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Another rank: the next version and its state dict (CPU tensors); None when rank 0 closed the group."""
        size = int(self._broadcast(torch.zeros(1, dtype=torch.long), self.wait_timeout_s).item())
        if size == CLOSED:
            return None
        data = self._broadcast(torch.empty(size, dtype=torch.uint8), self.op_timeout_s)
        header = json.loads(data.cpu().numpy().tobytes())
        if header.get("format") != HEADER_FORMAT:
            raise BroadcastError(f"weight broadcast header has format {header.get('format')!r}, "
                                 f"expected {HEADER_FORMAT!r}")
        buckets = [self._broadcast(torch.empty(n, dtype=torch.uint8), self.op_timeout_s).cpu()
                   for n in header["buckets"]]
        return int(header["version"]), unpack_buckets(header, buckets)

    def close(self) -> None:
        """Rank 0: tell the receivers the broadcasts are over (best effort: a broken group is closed already)."""
        if self.rank == 0:
            try:
                self._broadcast(torch.tensor([CLOSED], dtype=torch.long), self.op_timeout_s)
            except BroadcastError:
                pass  # a member is gone: the others' receives fail on their own


def group_prefix(token: str | None) -> str:
    """The prefix of the group's keys in the store: with a token, one only its holders can name (the store has
    no way to list its keys), so a member without it never meets the group."""
    if token is None:
        return "grpo-weights"
    return "grpo-weights/" + hmac.new(token.encode(), b"grpo-weight-broadcast", hashlib.sha256).hexdigest()


def _loopback_listener(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` for rank 0's store (TCPStore itself binds every interface)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise BroadcastError(f"weight broadcast store cannot listen on 127.0.0.1:{port}: {exc}") from exc
    return listener


def _make_group(backend: str, store, rank: int, size: int, timeout: datetime.timedelta):
    """A process group of ``size`` members over ``store``, registered nowhere (not the default group)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"weight broadcast backend {backend!r}; expected gloo or nccl")
