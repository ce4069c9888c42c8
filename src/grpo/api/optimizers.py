"""TRL's ``GRPOTrainer(optimizers=(optimizer, lr_scheduler))``, as transformers' Trainer takes them: the user's
optimizer over the model's parameters steps every update in place of grpo's AdamW, and the user's scheduler (a
``LambdaLR``-like object, stepped once per update) in place of the one ``optim.*`` builds; an optimizer without a
scheduler gets the arguments' schedule over it (Trainer's ``create_scheduler``). Checkpoints save and restore their
``state_dict()`` as they do grpo's own (``grpo.run.checkpoint``)."""

from __future__ import annotations

from typing import Any

import torch

DEEPSPEED_REFUSAL = (  # transformers 4's words for the same refusal; grpo's engine builds its own optimizer there
    "Passing `optimizers` is not allowed if Deepspeed is enabled. grpo's DeepSpeed engine (grpo_overrides "
    "train.deepspeed) builds its optimizer over its own flat, possibly offloaded copies of the parameters; drop one")


def given_optimizers(optimizers: Any, model: Any, config) -> tuple[torch.optim.Optimizer | None, Any]:
    """``(optimizer, lr_scheduler)`` checked against ``model`` (the trainer's, prepared) and the run ``config``:
    a tuple of two; a scheduler needs the optimizer it steps (Trainer would build a second optimizer that it never
    schedules); the optimizer must hold only ``model``'s parameters (one built over another copy would train
    nothing the run saves); not under DeepSpeed. A ValueError (TypeError for a bad shape) naming ``optimizers``."""
    if not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2:
        raise TypeError(f"optimizers must be a tuple (optimizer, lr_scheduler), got {optimizers!r}")
    optimizer, scheduler = optimizers
    if optimizer is None and scheduler is None:
        return None, None
    if config.train.deepspeed:
        raise ValueError(DEEPSPEED_REFUSAL)
    if optimizer is None:
        raise ValueError("GRPOTrainer(optimizers=(None, lr_scheduler)): a scheduler steps the optimizer it was built "
                         "over; pass that optimizer too, or (None, None) for grpo's AdamW and schedule")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizers[0] must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for group in optimizer.param_groups for p in group["params"])
    if foreign:
        raise ValueError(f"GRPOTrainer(optimizers=...): {foreign} of the optimizer's parameters are not the model's; "
                         "build it over model.parameters() of the model object passed to the trainer (a path is "
                         "loaded inside it: load the model yourself)")
    if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("GRPOTrainer(optimizers=...): the lr_scheduler steps another optimizer than the one given")
    return optimizer, scheduler
