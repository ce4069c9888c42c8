"""The per-token policy objectives of TRL 1.16's loss types, each the quantity maximised at a token before the
loss type's aggregation (``grpo.algorithm.aggregation.LOSS_TYPES`` names one per loss type):

- ``clip``: PPO's clipped surrogate ``min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` (grpo, bnpo, dr_grpo,
  dapo, luspo), with INTELLECT-2's two-sided clip ``delta``;
- ``cispo``: MiniMax-M1's ``sg(min(r, eps_max)) * A * log pi``: the clipped ratio only weighs the gradient;
- ``sapo``: SAPO's smooth gate ``sigmoid(tau * (r - 1)) * 4 / tau * A``;
- ``vespo``: VESPO's ``sg(phi(w)) * A * log pi`` with the Gamma weight ``phi`` of the sequence's ratio ``w``.

``N`` completions of padded length ``L``; ``r`` the importance ratio ``pi / pi_old`` ([N, L]; at the sequence
level every token holds its row's), ``A`` the advantages ([N, 1] one per row, or [N, L] one per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

_LOG_W_FLOOR = math.log(1e-8)  # VESPO's floor on log w (the reference implementation's w.clamp(min=1e-8))


def clipped_objective(ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float,
                      delta: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, with the ratio of the unclipped branch capped at ``delta``.

    Args:
        ratio: ``[N, L]`` importance ratios (with gradient).
        advantages: ``[N, 1]`` or ``[N, L]``, detached.
        epsilon_low, epsilon_high: the clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        delta: INTELLECT-2's two-sided clip (TRL's ``delta``): the unclipped branch uses ``min(r, delta)``. Only a
            negative advantage reaches it (a positive one is already held at ``1 + epsilon_high`` by the min), so a
            token whose ratio ran far above 1 with ``A < 0`` stops pushing at ``delta * A`` instead of without
            bound. None: no cap (TRL's default); meant to be above ``1 + epsilon_high``.

    Returns:
        ``(objective, cut_off)``, both ``[N, L]``: ``min(min(r, delta) * A, clip(r) * A)``, and True where a clip
        or the cap replaced ``r * A`` (the token's gradient is then 0).
    """
    unclipped = ratio * advantages  # [N, L]
    capped = unclipped if delta is None else torch.clamp(ratio, max=delta) * advantages  # [N, L]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages  # [N, L]
    objective = torch.min(capped, clipped)
    return objective, objective != unclipped


def cispo_objective(logprobs: Tensor, ratio: Tensor, advantages: Tensor, ratio_cap: float) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, TRL's ``"cispo"``): ``sg(min(r, ratio_cap)) * A * log pi`` per token.

    The capped ratio is a detached weight on the REINFORCE term, so no token's gradient is ever cut off (PPO's
    clip zeroes it), only damped. ``ratio_cap`` is ScaleRL's ``eps_max``, an absolute bound on ``r`` (TRL passes
    ``epsilon_high`` itself, not ``1 + epsilon_high``; the paper recommends 5.0).

    Args:
        logprobs: ``[N, L]`` current log-probs (with gradient).
        ratio: ``[N, L]`` importance ratios (detached here).
        advantages: ``[N, 1]`` or ``[N, L]``, detached.

    Returns:
        ``(objective, capped)``, both ``[N, L]``; ``capped``: ``r > ratio_cap`` with ``A > 0``, TRL's
        ``cispo_clip_ratio`` (a capped ratio with ``A <= 0`` is not counted there).
    """
    weight = torch.clamp(ratio, max=ratio_cap).detach()  # [N, L]
    return weight * advantages * logprobs, (ratio.detach() > ratio_cap) & (advantages > 0)


def sapo_objective(ratio: Tensor, advantages: Tensor, temperature_pos: float = 1.0,
                   temperature_neg: float = 1.05) -> Tensor:
    """SAPO (TRL's ``"sapo"``): ``sigmoid(tau * (r - 1)) * 4 / tau * A`` per token, ``[N, L]``.

    A smooth gate instead of a hard clip: at ``r = 1`` its slope in ``r`` is 1 (the on-policy gradient of
    ``r * A``), and it flattens as ``r`` leaves 1, faster for a larger ``tau``. ``tau`` is ``temperature_pos``
    where ``A > 0``, ``temperature_neg`` where ``A <= 0`` (a negative advantage is gated harder by default).

    Args:
        ratio: ``[N, L]`` importance ratios (with gradient).
        advantages: ``[N, 1]`` or ``[N, L]``, detached.
    """
    tau = torch.where(advantages > 0, ratio.new_tensor(temperature_pos), ratio.new_tensor(temperature_neg))
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


@torch.no_grad()
def vespo_weights(log_ratio: Tensor, advantages: Tensor, mask: Tensor, *, k_pos: float = 2.0, lambda_pos: float = 3.0,
                  k_neg: float = 3.0, lambda_neg: float = 2.0, sampler_weights: Tensor | None = None) -> Tensor:
    """VESPO's Gamma weight of each sequence, ``phi(w) = exp(lam + k log w - lam w)`` (``phi(1) = 1``), detached.

    ``w`` is the sequence's whole likelihood ratio ``prod_t r_t`` (a sum of log-ratios, not GSPO's mean), each
    token's log-ratio clamped to [-20, 20] and ``log w`` to [log 1e-8, 20]. ``phi`` rises as ``w^k`` below 1 and
    decays as ``exp(-lam w)`` above it; ``(k, lam)`` are the ``_pos`` pair where ``A >= 0``, else the ``_neg`` pair
    (``lam`` at least 1e-4). A NaN or infinite ``phi`` is 0.

    Args:
        log_ratio: ``[N, L]`` per-token ``log pi - log pi_old`` (whatever the importance-sampling level).
        advantages: ``[N, 1]`` or ``[N, L]``.
        mask: ``[N, L]`` 1 for the tokens that carry the loss; only they count in ``w``.
        sampler_weights: ``[N, L]`` per-token ``pi_old / pi_sampler`` weights (a token mode of the sampler
            correction), folded into ``w`` (their logs clamped to [log 1e-8, 20]) instead of multiplying the loss,
            as TRL does for vespo. A sequence mode's weight would count once per token: not for vespo.

    Returns:
        ``[N, 1]`` (``[N, L]`` for per-token advantages).
    """
    m = mask.to(log_ratio.dtype)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * m).sum(-1, keepdim=True)  # [N, 1]
    if sampler_weights is not None:  # padding's weight is masked out, whatever it holds (0 gives log 0 = -inf)
        log_is = torch.clamp(torch.log(sampler_weights.to(log_ratio.dtype)), _LOG_W_FLOOR, 20.0)
        log_w = log_w + (log_is * m).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, _LOG_W_FLOOR, 20.0)
    nonneg = advantages >= 0  # [N, 1] or [N, L]
    k = torch.where(nonneg, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
    lam = torch.where(nonneg, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg)).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_objective(logprobs: Tensor, weights: Tensor, advantages: Tensor) -> Tensor:
    """VESPO (TRL's ``"vespo"``): ``phi * A * log pi`` per token, ``[N, L]``; ``weights`` from ``vespo_weights``
    ([N, 1] or [N, L], detached), so the gradient is ``phi * A * grad log pi``."""
    return weights.detach() * advantages * logprobs


@dataclass(frozen=True)
class ObjectiveInputs:
    """What ``policy_loss`` hands every objective: tensors with 0 on padding, and the objectives' settings
    (TRL 1.16's GRPOConfig defaults)."""

    logprobs: Tensor  # [N, L] current log-probs, with gradient
    log_ratio: Tensor  # [N, L] per-token log pi - log pi_old, with gradient
    ratio: Tensor  # [N, L] importance ratio at the importance-sampling level, with gradient
    advantages: Tensor  # [N, 1] or [N, L], detached
    mask: Tensor  # [N, L] float
    sampler_weights: Tensor | None  # [N, L] detached, or None
    epsilon_low: float
    epsilon_high: float
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass(frozen=True)
class Surrogate:
    """An objective's result: ``objective`` [N, L] to maximise; ``cut_off`` [N, L] bool, the tokens its clip
    acted on (the ``clip_fraction`` statistic); ``sampler_weighted``: the sampler weights are already in it
    (else ``policy_loss`` multiplies them in); ``stats``: its own detached statistics."""

    objective: Tensor
    cut_off: Tensor
    sampler_weighted: bool = False
    stats: dict[str, Tensor] = field(default_factory=dict)


def _clip(x: ObjectiveInputs) -> Surrogate:
    return Surrogate(*clipped_objective(x.ratio, x.advantages, x.epsilon_low, x.epsilon_high, x.delta))


def _cispo(x: ObjectiveInputs) -> Surrogate:
    return Surrogate(*cispo_objective(x.logprobs, x.ratio, x.advantages, x.epsilon_high))


def _sapo(x: ObjectiveInputs) -> Surrogate:
    objective = sapo_objective(x.ratio, x.advantages, x.sapo_temperature_pos, x.sapo_temperature_neg)
    return Surrogate(objective, torch.zeros_like(objective, dtype=torch.bool))  # a smooth gate: nothing is cut off


def _vespo(x: ObjectiveInputs) -> Surrogate:
    phi = vespo_weights(x.log_ratio, x.advantages, x.mask, k_pos=x.vespo_k_pos, lambda_pos=x.vespo_lambda_pos,
                        k_neg=x.vespo_k_neg, lambda_neg=x.vespo_lambda_neg, sampler_weights=x.sampler_weights)
    objective = vespo_objective(x.logprobs, phi, x.advantages)
    # TRL's vespo/phi_seq_mean: over rows for [N, 1] weights (every row counts), over loss tokens for [N, L]
    phi_mean = phi.mean() if phi.shape[1] == 1 else (phi * x.mask).sum() / x.mask.sum().clamp(min=1)
    return Surrogate(objective, torch.zeros_like(objective, dtype=torch.bool), sampler_weighted=True,
                     stats={"vespo_phi_mean": phi_mean.detach()})


POLICY_OBJECTIVES: dict[str, Callable[[ObjectiveInputs], Surrogate]] = {
    "clip": _clip,
    "cispo": _cispo,
    "sapo": _sapo,
    "vespo": _vespo,
}
