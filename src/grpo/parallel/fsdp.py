"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) as the third learner (``train.fsdp``), beside
``TorchLearner`` (DDP) and ``DeepSpeedLearner``, behind the same ``Learner`` protocol.

Each decoder layer (the classes transformers' ``_no_split_modules`` names, or ``fsdp.layer_classes``) is one FSDP
unit and the rest (embeddings, final norm, LM head) the root unit. A unit's parameters are DTensors sharded on
dim 0 over the ranks; its forward all-gathers them (in bf16 under ``model.bf16``: ``MixedPrecisionPolicy``, fp32
shards as master weights) and frees them after, its backward reduce-scatters the gradients. The optimizer then
holds 1/N of the states on each rank.

Three things differ from DDP:

- Every forward of the policy is a collective (an all-gather per unit), so ranks must run the same passes.
  Sampling and its no-grad log-prob passes differ per rank (stopping at EOS, dynamic sampling's rounds), so they
  run inside ``gathered``: every unit gathered once, kept until the block ends, and no collective inside it. The
  update's micro-batches are made equal in number over the ranks (``LossSettings.equal_micro_batches``).
- The fused LM head (``grpo.algorithm.head``) calls the head outside the model's forward. The head is in the
  root unit, which FSDP2 never reshards after forward (it is needed first in backward), and whose gradients the
  root's post-backward callback reduces; so the head holds full parameters whenever it is called.
- Checkpoints are each rank's shards (``grpo.run.sharded_checkpoint``), and the full weights (final, best,
  published) are gathered tensor by tensor with only rank 0 keeping a CPU copy (``full_state_dict``).
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from grpo.config import ConfigError
from grpo.parallel.update_outcome import UpdateOutcome

try:  # a torch built without distributed support has no FSDP2: check_fsdp_available says so by name
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
except ImportError:
    torch_fsdp = init_device_mesh = DTensor = None

# unit -> its reshard_after_forward as configured (the root: False), restored after ``gathered`` changed it
_RESHARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class FsdpSettings:
    """How ``shard`` wraps a model (``train.fsdp`` and the ``fsdp`` section; built in ``grpo.parallel.trainable``)."""

    layer_classes: tuple[str, ...] = ()  # () = the model's _no_split_modules
    param_dtype: torch.dtype | None = None  # what units are gathered and computed in (None: as stored)
    reduce_dtype: torch.dtype | None = None  # what gradients are reduced in (None: param_dtype)
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    accumulate_unsharded: bool = False


def check_fsdp_available() -> None:
    """ConfigError naming ``train.fsdp`` for a torch without FSDP2's public API (torch >= 2.6)."""
    names = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
    missing = [name for name in names if not hasattr(torch_fsdp, name)]
    if missing or not dist.is_available():
        what = "torch.distributed.fsdp" if torch_fsdp is None else f"torch.distributed.fsdp.{', '.join(missing)}"
        raise ConfigError(f"train.fsdp: torch {torch.__version__} has no FSDP2 (no {what}); install a torch with "
                          "distributed support (>= 2.6) or set train.fsdp: false")


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (which holds ``_no_split_modules``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def layer_modules(model: torch.nn.Module, names: tuple[str, ...] = ()) -> list[torch.nn.Module]:
    """The modules of ``model`` that become FSDP units: instances of the classes ``names`` lists, or of the model's
    ``_no_split_modules`` when empty. ConfigError naming the key when none is found (FSDP2 over the root alone
    would gather the whole model at once: no memory saved)."""
    key = "fsdp.layer_classes" if names else "train.fsdp"
    wanted = set(names or getattr(_base_model(model), "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    if not found:
        where = (f"fsdp.layer_classes {sorted(wanted)}" if names else
                 f"{type(_base_model(model)).__name__}._no_split_modules {sorted(wanted) or 'is empty'}")
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"{key}: no module of the model is of a layer class ({where}); FSDP2 shards one decoder "
                          f"layer at a time; name the model's layer class in fsdp.layer_classes (its classes: "
                          f"{', '.join(classes[:12])}{' ...' if len(classes) > 12 else ''})")
    return found


def device_mesh(device_type: str):
    """The 1-D mesh of every rank (the default process group's)."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard(model: torch.nn.Module, settings: FsdpSettings, mesh) -> torch.nn.Module:
    """``fully_shard`` each layer of ``model`` (``layer_modules``), then the model itself as the root; in place
    (the model's class becomes its FSDP subclass, its parameters DTensors). Returns it. Frozen models (the
    reference) and frozen parameters (LoRA's base) are sharded alike and get no gradient."""
    fully_shard = torch_fsdp.fully_shard
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype)
    # pin_memory needs CUDA; a CPU-only torch has no pinned memory to give
    offload = (torch_fsdp.CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if settings.cpu_offload
               else torch_fsdp.OffloadPolicy())
    for layer in layer_modules(model, settings.layer_classes):
        fully_shard(layer, mesh=mesh, reshard_after_forward=settings.reshard_after_forward, mp_policy=policy,
                    offload_policy=offload)
        _RESHARD[layer] = settings.reshard_after_forward
    # The root keeps its parameters after forward (FSDP2's rule for the root): the fused head relies on it.
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    _RESHARD[model] = False
    return model


def is_sharded(model: torch.nn.Module | None) -> bool:
    return model is not None and model in _RESHARD


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if m in _RESHARD]


@contextmanager
def gathered(*models: torch.nn.Module | None):
    """Every unit of the sharded ``models`` (others and None are skipped) gathered on entry and kept until the
    block ends: passes inside run no collective, so ranks may run different passes there (sampling). The full
    parameters (in the gathered dtype) are in memory meanwhile, as under DDP. All ranks must enter together."""
    units = [unit for model in models if is_sharded(model) for unit in _units(model)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(_RESHARD[unit], recurse=False)


def gathering(*models: torch.nn.Module | None):
    """``gathered(*models)`` when any of them is sharded, else a context that does nothing."""
    return gathered(*models) if any(is_sharded(m) for m in models) else nullcontext()


class FsdpLearner:
    """AdamW (or any torch optimizer) over the sharded parameters + LambdaLR; gradients clipped by their global
    norm over the ranks' shards. By default every micro-batch's backward reduce-scatters (only the shards of
    the accumulated gradient are kept); with ``accumulate_unsharded`` only the update's last one does, and the
    gathered parameters stay from the first micro-batch to the last (no collective in between)."""

    def __init__(self, module: torch.nn.Module, optimizer, scheduler, max_grad_norm: float | None,
                 accumulate_unsharded: bool = False):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.accumulate_unsharded = accumulate_unsharded
        self.params = [p for p in module.parameters() if p.requires_grad]

    def accumulating(self, last: bool):
        if self.accumulate_unsharded:
            self.module.set_requires_gradient_sync(last)
            self.module.set_reshard_after_backward(last)
            for unit in _units(self.module):  # restored in finish_update
                unit.set_reshard_after_forward(False, recurse=False)
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_update(self) -> UpdateOutcome:
        if self.accumulate_unsharded:
            for unit in _units(self.module):
                unit.set_reshard_after_forward(_RESHARD[unit], recurse=False)
        # As TorchLearner: a non-finite norm skips the update. The norm of sharded gradients is a partial one
        # per rank; full_tensor() sums the squares over the ranks (one all-reduce).
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        value = float(norm)
        applied = math.isfinite(value)
        if applied:
            if self.max_grad_norm:
                torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return UpdateOutcome(value if applied else None)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """See ``full_state_dict``."""
        return full_state_dict(self.module)


def _trains_part(model: torch.nn.Module) -> bool:
    """Whether only part of ``model`` trains (a LoRA adapter over a frozen base)."""
    return any(not p.requires_grad for p in model.parameters())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full tensors of sharded ``model`` (a collective: every rank calls it), on rank 0 as CPU copies and {}
    elsewhere; with a frozen part (LoRA's base) only the trained tensors, which is what a peft model saves or
    publishes. Gathered one tensor at a time, so beyond rank 0's copy no rank holds the whole model."""
    return dict(full_tensors(model))


def _kept_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's entries a full copy holds, in order: a tied weight once (the objects themselves: a tie is
    one object under two names), a frozen one not at all when only part of the model trains."""
    trains_part = _trains_part(model)
    seen: set[int] = set()
    kept = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        trained = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
        if id(tensor) in seen or (trains_part and not trained):
            continue
        seen.add(id(tensor))
        kept.append((name, tensor))
    return kept


def full_tensor_layout(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, full shape)`` of each tensor ``full_tensors`` yields, in its order, without communication
    (a DTensor knows its global shape): what a file needs before the first tensor is gathered."""
    return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in _kept_tensors(model)]


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full CPU tensor)`` of ``model``'s state dict in order (``_kept_tensors``), one all-gather each; rank
    0 gets every pair, the other ranks iterate the same collectives and get nothing."""
    keep = dist.get_rank() == 0
    for name, tensor in _kept_tensors(model):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            yield name, full.detach().to("cpu", copy=True)
