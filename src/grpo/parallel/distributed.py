"""Everything about ranks in one place: init, reductions, main-process printing, clean shutdown.

Single-process runs need no launcher; under ``torchrun`` (WORLD_SIZE > 1) a process group is
created with gloo on CPU and NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpo.parallel import rank_failure


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_kind: str = "cpu", timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group torchrun describes in the environment (no-op for one process). ``timeout_s``:
    how long a collective may wait for the slowest rank before it fails."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    # Rank 0 hosts the store itself unless torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE).
    hosts_store = info.is_main and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    rank_failure.start_watch(dist.distributed_c10d._get_default_store(), info.rank, info.world_size, hosts_store)
    return info


def one_process_group(device_kind: str) -> None:
    """A process group of this one process, for a library that needs one even alone (DeepSpeed: without one, and
    without a launcher's variables, it goes looking for MPI). The store is in memory: nothing listens, and the
    environment a launcher sets is not faked (grpo reads WORLD_SIZE to know it was launched)."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def all_reduce_mean(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Mean of a tensor over ranks (identity for one process). Returns a new tensor."""
    out = values.detach().clone()
    if info.enabled:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        out /= info.world_size
    return out


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of a tensor over ranks (identity for one process). Returns a new tensor."""
    out = values.detach().clone()
    if info.enabled:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Elementwise maximum of a tensor over ranks (identity for one process). Returns a new tensor."""
    out = values.detach().clone()
    if info.enabled:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def all_gather_json(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (JSON values), in rank order; ``[obj]`` for one process. For small values whose
    shape differs between ranks (a reward's logged metrics), where a tensor reduction cannot go. As JSON
    bytes in tensors: torch.distributed's object collectives pickle, and no peer's bytes are unpickled."""
    if not info.enabled:
        return [obj]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)  # [n]
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(info.world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = max(int(size) for size in sizes)
    padded = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(info.world_size)]
    dist.all_gather(padded, torch.nn.functional.pad(data, (0, longest - data.numel())))
    return [json.loads(bytes(row[:int(size)].tolist()).decode()) for row, size in zip(padded, sizes)]


def barrier(info: DistInfo) -> None:
    """Wait for every rank (no-op for one process)."""
    if info.enabled:
        dist.barrier()


# DDP wrappers held for the life of the process (``keep_until_exit``).
_HELD_UNTIL_EXIT: list = []


def keep_until_exit(obj):
    """Hold ``obj`` (a DDP-wrapped module) until the process exits, and return it.

    Why: freeing DDP's Reducer can drop the last reference to its gloo process group, whose destructor
    joins the group's worker threads while holding the GIL; a worker still finishing the last
    collective's cleanup needs the GIL to drop a Python reference, and the rank hangs for ever (seen once
    under heavy load: rank 1 of a 2-rank CPU run stuck in ``~ProcessGroupGloo -> std::thread::join``
    under the Reducer's dealloc as ``train`` returned, its worker in ``gil_scoped_acquire``). Held here,
    the wrapper outlives ``train``; ``python -m grpo`` under torchrun then ends with ``os._exit`` after
    flushing (``grpo.__main__``), so it is never torn down at all."""
    _HELD_UNTIL_EXIT.append(obj)
    return obj


def shutdown(info: DistInfo, failed: BaseException | None = None) -> None:
    """Barrier then destroy: without the barrier a fast rank 0 may tear the group down under rank 1. After
    this rank ``failed`` (not a Ctrl-C, which every rank takes at the same step), no collective: the failure
    goes to every rank through the store (``grpo.parallel.rank_failure``) and the process exits as it is."""
    if not (info.enabled and dist.is_initialized()):
        return
    watch = rank_failure.current_watch()
    if failed is not None and not isinstance(failed, KeyboardInterrupt) and watch is not None:
        watch.fail(failed)
        return
    rank_failure.stop_watch()
    dist.barrier()
    dist.destroy_process_group()


def print0(info: DistInfo, *args, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if info.is_main:
        print(*args, **kwargs, flush=True)
