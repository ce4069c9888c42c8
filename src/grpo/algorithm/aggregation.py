"""How a per-token loss becomes a scalar: the aggregations (``LOSS_AGGREGATIONS``), and every TRL 1.16
``loss_type`` as the pair (per-token objective, aggregation) (``LOSS_TYPES``).

``N`` completions of padded length ``L``; masks are ``[N, L]``, 1 for the tokens that carry the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor


# Each aggregation: (per_token [N, L], mask [N, L], normalizer, max_len) -> scalar.
def _agg_grpo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    # Mean over each sequence's tokens, then over sequences; an all-masked row counts as 0.
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    return per_seq.mean()


def _agg_bnpo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _agg_dr_grpo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    if max_len is None:
        raise ValueError("loss_type 'dr_grpo' needs max_completion_length (the constant normaliser)")
    return (per_token * mask).sum() / (mask.shape[0] * max_len)


def _agg_dapo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    # Global token count across ranks/micro-batches when the caller passes it; local count otherwise.
    denom = mask.sum().clamp(min=1) if normalizer is None else normalizer
    return (per_token * mask).sum() / denom


def _agg_luspo(per_token: Tensor, mask: Tensor, normalizer, max_len) -> Tensor:
    # LUSPO (TRL's "luspo"): each sequence's loss is its tokens' sum, not their mean, so a sequence weighs by its
    # length (GSPO's per-sequence mean favours short completions); then the mean over sequences.
    return (per_token * mask).sum(-1).mean()


@dataclass(frozen=True)
class LossAggregation:
    """A loss_type: how a micro-batch's per-token loss becomes a scalar (``reduce``), and how micro-batches
    add up to the whole batch's loss under gradient accumulation (``micro_batch_weights``).

    per_row: the loss is a mean over rows (a micro-batch weighs by its rows), not over tokens (by its tokens).
    global_normalizer: ``reduce`` already divides by the whole batch's token count (the ``normalizer``
        over ranks and micro-batches), so a micro-batch's loss is added with weight 1.
    """

    reduce: Callable[..., Tensor]
    per_row: bool
    global_normalizer: bool = False

    def micro_batch_weights(self, rows: int, tokens: Tensor, total_rows: int,
                            total_tokens: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """(the weight of a micro-batch's loss, so that the accumulated gradient equals the batch's; its
        share of the batch, which weighs its statistics). ``tokens``/``total_tokens``: 0-d counts."""
        share = rows / total_rows if self.per_row else tokens / total_tokens.clamp(min=1)
        return (1.0 if self.global_normalizer else share), share

    def rank_scale(self, rows: int, mean_rows: Tensor | float, tokens: Tensor, mean_tokens: Tensor) -> Tensor | float:
        """The factor on one rank's loss when the ranks hold different shares of a step's batch, so that DDP's
        mean of the ranks' gradients is the gradient of the whole batch's loss: each rank's loss is a mean over
        its own rows (grpo, dr_grpo) or tokens (bnpo), which the plain mean over ranks would weigh alike. A
        per-row mean is scaled by the rank's rows over the mean rows per rank, a token mean by its loss tokens
        over the mean tokens per rank (0-d counts; ``mean_tokens`` > 0), a loss already divided by the global
        token count (dapo) by 1. Exactly 1 for a per-row mean when every rank holds as many rows."""
        if self.global_normalizer:
            return 1.0
        return rows / mean_rows if self.per_row else tokens / mean_tokens


# The clipped surrogate's loss types; the config's loss.loss_type choices are these names.
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "grpo": LossAggregation(_agg_grpo, per_row=True),
    "bnpo": LossAggregation(_agg_bnpo, per_row=False),
    "dr_grpo": LossAggregation(_agg_dr_grpo, per_row=True),
    "dapo": LossAggregation(_agg_dapo, per_row=False, global_normalizer=True),
}


@dataclass(frozen=True)
class LossType:
    """A TRL 1.16 ``loss_type``: the per-token objective it maximises (a name in
    ``grpo.algorithm.objectives.POLICY_OBJECTIVES``) and how that is reduced to a scalar."""

    objective: str
    aggregation: LossAggregation


# As TRL's GRPOTrainer._compute_loss pairs them: cispo and vespo divide by the global token count as dapo does,
# sapo takes grpo's per-sequence mean, luspo the per-sequence sum.
LOSS_TYPES: dict[str, LossType] = {
    **{name: LossType("clip", aggregation) for name, aggregation in LOSS_AGGREGATIONS.items()},
    "luspo": LossType("clip", LossAggregation(_agg_luspo, per_row=True)),
    "cispo": LossType("cispo", LOSS_AGGREGATIONS["dapo"]),
    "sapo": LossType("sapo", LOSS_AGGREGATIONS["grpo"]),
    "vespo": LossType("vespo", LOSS_AGGREGATIONS["dapo"]),
}


def loss_type_entry(loss_type: str) -> LossType:
    """``LOSS_TYPES[loss_type]``; ValueError listing the known ones, the clipped surrogate's apart."""
    if loss_type not in LOSS_TYPES:
        others = sorted(set(LOSS_TYPES) - set(LOSS_AGGREGATIONS))
        raise ValueError(f"unknown loss_type {loss_type!r}; known: {sorted(LOSS_AGGREGATIONS)} (the clipped surrogate) "
                         f"and {others} (objectives of their own)")
    return LOSS_TYPES[loss_type]


def loss_aggregation(loss_type: str) -> LossAggregation:
    """The aggregation of any name in ``LOSS_TYPES`` (``LOSS_AGGREGATIONS``' own for its four); ValueError
    listing the known ones."""
    return loss_type_entry(loss_type).aggregation


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    *,
    normalizer: float | Tensor | None = None,
    max_completion_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[N, L]`` with a ``[N, L]`` 0/1 mask to a scalar by ``loss_type``.

    ``grpo`` (and ``sapo``): masked mean per sequence, then mean over sequences; ``bnpo``: masked sum / masked
    count; ``dr_grpo``: masked sum / (N * max_completion_length); ``dapo`` (and ``cispo``, ``vespo``): masked sum /
    ``normalizer`` (the global token count over ranks and micro-batches), or the local count when it is None;
    ``luspo``: masked sum per sequence, then mean over sequences.
    """
    return loss_aggregation(loss_type).reduce(per_token, mask.to(per_token.dtype), normalizer, max_completion_length)
