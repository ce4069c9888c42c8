"""TRL's adaptive entropy coefficient (``use_adaptive_entropy``, Skywork-OR1) across a run's optimizer updates: the
coefficient every micro-batch of an update applies, the update's entropy summed over its micro-batches and ranks,
and the coefficient's step after it (the pure rule: ``grpo.algorithm.entropy``). Its state is checkpointed with the
run (``state_dict``), so a resumed run applies what the uninterrupted one would."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpo.algorithm import AdaptiveEntropyState, adaptive_entropy_step, applied_entropy_coef
from grpo.parallel.distributed import DistInfo, all_reduce_sum


@dataclass
class EntropyControl:
    """The controller of one run (``loss.adaptive_entropy``): ``state`` between updates, ``window`` the current
    update's [2] (entropy sum, token count) on the policy's device, None before its first micro-batch."""

    state: AdaptiveEntropyState
    target: float
    coef_delta: float
    coef_min: float
    coef_max: float
    window: torch.Tensor | None = field(default=None, repr=False)

    def coef(self) -> float:
        """The coefficient every micro-batch of the coming update applies (0 until the entropy has fallen to the
        target: ``applied_entropy_coef``)."""
        return applied_entropy_coef(self.state, self.target)

    def add(self, sums: torch.Tensor) -> None:
        """A micro-batch's [2] ``entropy_sums`` of the tokens its bonus acted on."""
        self.window = sums.detach().double() if self.window is None else self.window + sums.detach().double()

    def end_update(self, info: DistInfo) -> float:
        """After an update's last micro-batch: its entropy over every rank (one collective, one host read), the
        coefficient's step; returns the coefficient after it (what TRL logs as entropy_coef at each optimizer step;
        the update itself applied ``coef()`` as it was before)."""
        sums = all_reduce_sum(self.window, info) if self.window is not None else torch.zeros(2, dtype=torch.float64)
        self.state = adaptive_entropy_step(self.state, sums.tolist(), target=self.target, coef_delta=self.coef_delta,
                                           coef_min=self.coef_min, coef_max=self.coef_max)
        self.window = None
        return self.state.coef

    def state_dict(self) -> dict:
        """The checkpoint's part: JSON values (the last entropy inf before the first update is stored as null)."""
        last = self.state.last_entropy
        return {"coef": self.state.coef, "last_entropy": None if math.isinf(last) else last}

    def load_state_dict(self, saved: dict) -> None:
        last = saved.get("last_entropy")
        self.state = AdaptiveEntropyState(float(saved["coef"]), math.inf if last is None else float(last))


def entropy_control(cfg, resumed: dict | None) -> EntropyControl | None:
    """The run's controller when ``loss.adaptive_entropy`` is on (None otherwise): from ``loss.entropy_coef`` and the
    target/step/bounds keys, its state the checkpoint's when the run resumes one (``resumed``: its trainer state)."""
    loss = cfg.loss
    if not loss.adaptive_entropy:
        return None
    control = EntropyControl(AdaptiveEntropyState(loss.entropy_coef), loss.entropy_target, loss.entropy_coef_delta,
                             loss.entropy_coef_min, loss.entropy_coef_max)
    if resumed and resumed.get("adaptive_entropy") is not None:
        control.load_state_dict(resumed["adaptive_entropy"])
    return control
