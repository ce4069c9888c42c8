"""What one optimizer update did (``UpdateOutcome``), the value every learner's ``finish_update`` returns
(``grpo.parallel.learners``, ``grpo.parallel.fsdp``)."""

from __future__ import annotations

from dataclasses import dataclass

# An overflow at a loss scale this low or lower counts as a non-finite update: the gradients overflow float16
# without any scaling (DeepSpeed's min_loss_scale, where its engine stops the run).
MIN_LOSS_SCALE = 1.0


@dataclass(frozen=True)
class UpdateOutcome:
    """What one optimizer update did. grad_norm: the gradient norm before clipping, None when the update was
    skipped; overflow: skipped by fp16's loss scaler, the scale above ``MIN_LOSS_SCALE`` and the loss finite (the
    scale was halved: the scaler's warm-up or a spike; the run's guard does not count it); loss_scale: fp16's scale
    for the next update (None without loss scaling)."""

    grad_norm: float | None
    overflow: bool = False
    loss_scale: float | None = None
