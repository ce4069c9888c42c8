"""How gradients become an update: plain torch (one process or DDP), a DeepSpeed ZeRO engine, or FSDP2
(``grpo.parallel.fsdp``'s ``FsdpLearner``).

``train_on_batch`` drives either through the same four calls, so the update loop is written once:
``accumulating(last)`` (a context for one micro-batch), ``backward(loss)``, ``finish_update()``
(clip, step, schedule; returns an ``UpdateOutcome``: the gradient norm, None when the update was skipped) and ``lr``.

fp16 (``model.fp16``) scales the loss in backward and skips an update whose gradients overflowed: torch's
``GradScaler`` in the torch learner, DeepSpeed's own loss scaler in its engine. Such a skip is the scaler doing
its work (its first updates find the largest scale that fits float16), so it is told apart from a non-finite
gradient (``UpdateOutcome.overflow``), which the run's guard counts (``grpo.training.guards.SkipGuard``).
"""

from __future__ import annotations

import math
import re
import os
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Protocol

import torch
import torch.distributed as dist

from grpo.config import ConfigError
from grpo.config.deepspeed_json import read_deepspeed_json
from grpo.models.compiled import CompiledDecoder
from grpo.parallel.distributed import keep_until_exit, one_process_group
from grpo.parallel.fsdp import FsdpLearner
from grpo.parallel.update_outcome import MIN_LOSS_SCALE, UpdateOutcome

class Learner(Protocol):
    module: torch.nn.Module  # what the training forward pass calls (DDP wrapper / DeepSpeed engine)

    def accumulating(self, last: bool): ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def finish_update(self) -> UpdateOutcome: ...
    @property
    def lr(self) -> float: ...


class TorchLearner:
    """AdamW (or any torch optimizer) + LambdaLR, with DDP's ``no_sync`` on all but the last micro-batch;
    ``scaler``: fp16's loss scaler (None: none); ``compiled``: the decoder each micro-batch runs compiled
    (``train.torch_compile``; None: eager)."""

    def __init__(self, module: torch.nn.Module, optimizer, scheduler, max_grad_norm: float | None,
                 scaler: torch.amp.GradScaler | None = None, compiled: CompiledDecoder | None = None):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.max_grad_norm, self.scaler, self.compiled = max_grad_norm, scaler, compiled
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._loss_finite: torch.Tensor | None = None  # fp16: every loss of the update was finite (0-d bool)

    def accumulating(self, last: bool):
        stack = ExitStack()
        if not last and hasattr(self.module, "no_sync"):
            stack.enter_context(self.module.no_sync())
        if self.compiled is not None:
            stack.enter_context(self.compiled.active())
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is None:
            loss.backward()
            return
        finite = torch.isfinite(loss.detach())
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self.scaler.scale(loss).backward()

    def finish_update(self) -> UpdateOutcome:
        # A non-finite norm skips the update: one bad batch must not poison the weights. Deciding that
        # needs the norm on the host: its one sync per update, read once as a float (not bool() and then
        # float(), two). foreach (torch's default on CUDA and CPU) norms and scales all gradients in a
        # few kernels; foreach=True would raise on devices without those kernels.
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # the true gradients, before clipping reads them
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or float("inf"))
        if self.scaler is None:
            value, loss_finite = float(norm), True
        else:  # the loss's finiteness rides along in the same transfer
            finite = self._loss_finite if self._loss_finite is not None else torch.ones((), dtype=torch.bool)
            value, loss_finite = torch.stack([norm.float(), finite.to(norm.device).float()]).tolist()
        applied = math.isfinite(value)
        if applied:
            self.optimizer.step()
            # Under bf16 autocast (fp32 master weights) the bf16 copies autocast caches of the weights
            # are stale now: torch keeps them until the autocast context exits, which a run never does.
            torch.clear_autocast_cache()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.scaler is None:
            return UpdateOutcome(value if applied else None)
        return self._scaled_outcome(value if applied else None, bool(loss_finite))

    def _scaled_outcome(self, norm: float | None, loss_finite: bool) -> UpdateOutcome:
        """fp16: the scaler's update (halve after an overflow, grow after a run of clean updates) and its outcome.
        The update was skipped by the same test the scaler makes (a non-finite gradient after unscaling; the
        scaler's ``step`` is not used, so that both learners skip on one rule)."""
        scale = self.scaler.get_scale()  # the scale this update's gradients carried (no wait: the norm was read)
        self.scaler.update()
        self._loss_finite = None
        overflow = norm is None and loss_finite and scale > MIN_LOSS_SCALE
        return UpdateOutcome(norm, overflow=overflow, loss_scale=self.scaler.get_scale())

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


class DeepSpeedLearner:
    """A DeepSpeed engine that steps at the update's last micro-batch, however many the update has.

    Our micro-batch weights already make the accumulated gradient equal the whole batch's, so the
    engine's own 1/GAS scaling is turned off (``scale_wrt_gas=False``). ``accumulating(last)`` tells the
    engine where the boundary is (``set_gradient_accumulation_boundary``, which overrides its count of
    ``gradient_accumulation_steps``: a partial-rollout step's micro-batches vary); ``engine.step()`` after
    each backward then applies the update (with the LR schedule and the config's ``gradient_clipping``)
    only at that boundary. The engine's ``micro_steps`` counts backwards, ``global_steps`` updates.
    """

    def __init__(self, engine, fp16: bool = False):
        self.module = engine
        self.engine = engine
        self.fp16 = fp16  # the engine's fp16 section is on: its loss scaler skips updates that overflow

    def accumulating(self, last: bool):
        # Set before the micro-batch's forward, as the engine asks: its backward hooks read it.
        self.engine.set_gradient_accumulation_boundary(last)
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()

    def finish_update(self) -> UpdateOutcome:
        if not self.fp16:
            norm = self.engine.get_global_grad_norm()
            return UpdateOutcome(None if norm is None else float(norm))
        # Every DeepSpeed fp16 optimizer (ZeRO 1-3, fused, unfused) has a loss_scale property; at its floor
        # (min_loss_scale, 1) DeepSpeed raises and stops the run itself, so every skip above it is an overflow.
        scale = float(self.engine.optimizer.loss_scale)
        if not self.engine.was_step_applied():
            return UpdateOutcome(None, overflow=True, loss_scale=scale)
        norm = self.engine.get_global_grad_norm()
        return UpdateOutcome(None if norm is None else float(norm), loss_scale=scale)

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]


def deepspeed_config(path: str | dict, *, micro_batch_size: int, accumulation_steps: int, world_size: int,
                     max_grad_norm: float | None, bf16: bool, fp16: bool = False) -> dict:
    """A DeepSpeed config (a JSON file, or the mapping itself) with the batch fields filled from ours (``"auto"`` or
    absent), and its bf16/fp16 sections from ``model.bf16``/``model.fp16`` where it has none (fp16: DeepSpeed's
    dynamic loss scaling with its own defaults, as Trainer leaves them).

    Values the user wrote must agree with the run's; a disagreement is a configuration error, not a
    silently different batch (or precision: the learner's skips depend on the fp16 section).
    """
    config = read_deepspeed_json(path)
    where = path if isinstance(path, str) else "the given mapping"
    ours = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": micro_batch_size * accumulation_steps * world_size,
        "gradient_clipping": max_grad_norm or 0.0,
    }
    for key, value in ours.items():
        given = config.get(key, "auto")
        if given != "auto" and given != value:
            raise ConfigError(f"train.deepspeed: {where}: {key} is {given} but the run needs {value} "
                              f"(set it to \"auto\" to take it from the grpo config)")
        config[key] = value
    config.setdefault("bf16", {"enabled": bf16})
    section = config.setdefault("fp16", {"enabled": fp16})
    if section.get("enabled", "auto") == "auto":
        section["enabled"] = fp16
    elif bool(section["enabled"]) != fp16:
        raise ConfigError(f"train.deepspeed: {where}: fp16.enabled is {section['enabled']} but model.fp16 is {fp16} "
                          "(set it to \"auto\" to take it from the grpo config)")
    config.setdefault("steps_per_print", 10**9)  # our own metrics; no DeepSpeed step logging
    return config


MIN_DEEPSPEED = (0, 19, 8)  # pyproject's floor: 0.18.0's ZeRO-2 kept only the last micro-batch's gradient


def check_deepspeed_version(version: str) -> None:
    """ConfigError for a deepspeed older than grpo's floor (one installed beside grpo, not by its extra)."""
    release = tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])
    if release < MIN_DEEPSPEED:
        minimum = ".".join(map(str, MIN_DEEPSPEED))
        raise ConfigError(f"train.deepspeed: deepspeed {version} is installed; grpo needs >= {minimum} "
                          f"(pip install 'deepspeed>={minimum}'): older ZeRO-2 kept only each rank's last "
                          "micro-batch gradient of an update (docs/getting-started/install.md)")


@contextmanager
def local_rank_for_deepspeed():
    """DeepSpeed's engine asserts that LOCAL_RANK is set, which only launchers do: a process alone (one GPU, a
    notebook) gets LOCAL_RANK=0 while the engine is built, and its environment back afterwards, as other libraries
    (accelerate) read a set LOCAL_RANK as "launched"."""
    if "LOCAL_RANK" in os.environ:
        yield
        return
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        del os.environ["LOCAL_RANK"]


def build_learner(model: torch.nn.Module, optimizer, scheduler, *, ddp: bool, deepspeed_config_dict: dict | None,
                  max_grad_norm: float | None, scaler: torch.amp.GradScaler | None = None,
                  compiled: CompiledDecoder | None = None) -> Learner:
    """A DeepSpeed learner when a DeepSpeed config is given, else torch (DDP-wrapped when ``ddp``; ``scaler`` and
    ``compiled``: ``TorchLearner``'s)."""
    if deepspeed_config_dict is not None:
        import deepspeed  # optional extra (grpo[deepspeed])

        check_deepspeed_version(deepspeed.__version__)
        one_process_group(next(model.parameters()).device.type)  # alone, DeepSpeed would look for MPI
        with local_rank_for_deepspeed():
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=deepspeed_config_dict)
        return DeepSpeedLearner(engine, fp16=bool(deepspeed_config_dict.get("fp16", {}).get("enabled")))
    # keep_until_exit: tearing a DDP wrapper down can deadlock a rank (see there).
    module = keep_until_exit(torch.nn.parallel.DistributedDataParallel(model)) if ddp else model
    return TorchLearner(module, optimizer, scheduler, max_grad_norm, scaler, compiled)


def full_weights(learner: Learner) -> dict[str, torch.Tensor] | None:
    """The full weights when the learner's parameters are shards (ZeRO-3, FSDP2; a collective: every rank must call
    it): on rank 0 a CPU copy, {} on the others; None when the module's own parameters are complete."""
    if isinstance(learner, FsdpLearner):
        return learner.full_state_dict()
    return zero3_full_state_dict(learner)


def zero3_full_state_dict(learner: Learner, bucket_numel: int = 1 << 25) -> dict[str, torch.Tensor] | None:
    """The full weights under ZeRO-3, where each rank holds only a shard (a collective: every rank must call
    it): on rank 0 a CPU copy, {} on the others; None without ZeRO-3 (the module's own parameters are
    complete). Parameters are gathered ``bucket_numel`` elements at a time, and only rank 0 copies them, so
    no rank holds the whole model unsharded and no other node makes a CPU copy of it."""
    engine = getattr(learner, "engine", None)
    if engine is None or engine.zero_optimization_stage() != 3:
        return None
    import deepspeed  # optional extra (grpo[deepspeed])

    module = engine.module
    keep = not dist.is_initialized() or dist.get_rank() == 0
    saved = set(module.state_dict())  # names only: the tensors are empty shards here
    # named_parameters yields a tied weight (lm_head = embeddings) once, under its first name, as HF saves it.
    parameters = [(n, p) for n, p in module.named_parameters() if n in saved]
    gathered: dict[str, torch.Tensor] = {}
    for bucket in _buckets(parameters, bucket_numel):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
            if keep:
                gathered.update((n, p.detach().cpu().clone()) for n, p in bucket)
    if keep:  # buffers are not partitioned
        gathered.update((n, b.detach().cpu().clone()) for n, b in module.named_buffers() if n in saved)
    return gathered


def _buckets(named: list[tuple[str, torch.nn.Parameter]], numel: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of parameters of about ``numel`` elements (a larger parameter alone)."""
    buckets, current, size = [], [], 0
    for name, param in named:
        n = getattr(param, "ds_numel", param.numel())  # a ZeRO-3 parameter's full size
        if current and size + n > numel:
            buckets.append(current)
            current, size = [], 0
        current.append((name, param))
        size += n
    return buckets + ([current] if current else [])
