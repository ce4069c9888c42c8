"""One micro-batch's loss: the policy's log-probs of its rows (one forward, the entropy off the same logits), the
loss type's objective with its masks (``policy_loss``), the entropy bonus and an MoE's load-balancing term, and
what its statistics are read from (``MicroBatchLoss``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.algorithm import entropy_bonus, high_entropy_mask, off_policy_mask, policy_loss, sampler_importance_weights
from grpo.models.routing_replay import Replaying
from grpo.step.logprobs import completion_logprobs
from grpo.step.update_inputs import LossInputs, LossSettings


@dataclass
class MicroBatchLoss:
    """One micro-batch's loss and what its statistics are read from (``b`` rows).

    loss: 0-d, ``policy_loss``'s; weight: its weight in the batch's gradient (float or 0-d); bonus: 0-d, the
    entropy bonus's term already weighted (coef x the micro-batch's entropy x its share of the update's rows), taken
    off ``loss * weight`` in backward (0.0 without one);
    stats: ``policy_loss``'s statistics; entropy: [b, Lc] off the same forward's logits;
    old: [b, Lc] the old log-probs the surrogate used; mask, sampled: [b, Lc] the rows' of ``LossInputs``;
    is_weights, outside: [b, Lc] the sampler correction's weights and where they were capped (None: off);
    sampler: [b, Lc] the sampler's log-probs (None: off); current: [b, Lc] this pass's log-probs, detached;
    reported: [b, Lc] the rows' ``LossInputs.reported_logprobs`` (None: none);
    router_aux: 0-d, the rows' load-balancing loss (an MoE policy's; None: not added), and ``routing`` its term
    already weighted (coef x it x the micro-batch's share of the update's rows, TRL's 1 / GA), added in backward.
    """

    loss: torch.Tensor
    weight: torch.Tensor | float
    stats: dict[str, torch.Tensor]
    entropy: torch.Tensor
    old: torch.Tensor
    mask: torch.Tensor
    sampled: torch.Tensor
    is_weights: torch.Tensor | None
    outside: torch.Tensor | None
    sampler: torch.Tensor | None
    current: torch.Tensor
    reported: torch.Tensor | None
    bonus: torch.Tensor | float = 0.0
    bonus_mask: torch.Tensor | None = None  # [b, Lc] the tokens the entropy bonus acts on (None: no bonus)
    router_aux: torch.Tensor | None = None
    routing: torch.Tensor | float = 0.0

    @property
    def objective(self) -> torch.Tensor:
        """What backward runs on: the weighted policy loss less the weighted entropy bonus, plus the weighted
        load-balancing loss."""
        return self.loss * self.weight - self.bonus + self.routing


def loss_token_masks(entropy: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor,
                     behaviour: torch.Tensor, s: LossSettings) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the 0/1 factor on each token's surrogate: the high-entropy mask times the off-policy mask; the high-entropy
    mask alone, which the entropy bonus also keeps to), each [b, Lc] float or None when off. ``behaviour``: [b, Lc]
    the log-probs of the policy that sampled (the sampler's own, else the old ones)."""
    high = off = None
    if s.top_entropy_quantile < 1.0:
        high = high_entropy_mask(entropy, mask, s.top_entropy_quantile).to(mask.dtype)
    if s.off_policy_mask_threshold is not None:
        off = off_policy_mask(advantages, logprobs, behaviour, mask, s.off_policy_mask_threshold).to(mask.dtype)
    both = high if off is None else off if high is None else high * off
    return both, high


def micro_batch_loss(module: torch.nn.Module, inputs: LossInputs, rows: torch.Tensor, on_device: torch.Tensor,
                     old_logprobs: torch.Tensor | None, s: LossSettings,
                     entropy_coef: float | None = None, replaying: Replaying | None = None) -> MicroBatchLoss:
    """The clipped-surrogate loss of the batch's ``rows`` (CPU indices; ``on_device``: the same on the
    policy's device) under ``module``. ``old_logprobs`` [N, Lc], or None: the pass's own, detached (the
    first iteration's weights are still the ones that sampled). ``entropy_coef``: the bonus's coefficient for this
    update (an adaptive controller's); None: ``s.entropy_coef``. ``replaying``: routing replay's open hooks (the
    rows' recorded experts are fed to them)."""
    coef = s.entropy_coef if entropy_coef is None else entropy_coef
    gen = inputs.generation
    lp = s.logprob_pass
    # The entropy is read off this forward's logits (no pass of its own), an MoE's routing off its routers.
    scored = completion_logprobs(module, gen.prompt_ids[rows], gen.prompt_mask[rows],
                                 gen.completion_ids[rows], gen.completion_mask[rows], s.temperature,
                                 share_prompts=lp.share_prompts, column_bucket=lp.column_bucket,
                                 fused_head=lp.fused_head, pack=lp.pack, with_entropy=True,
                                 processing=s.processing, entropy_grad=coef > 0,
                                 router_top_k=s.router.top_k if s.router is not None else None,
                                 routing=None if replaying is None else gen.routing[rows], replaying=replaying)
    logprobs, entropy = scored[:2]  # [b, Lc] each
    old = old_logprobs[on_device] if old_logprobs is not None else logprobs.detach()
    ref = inputs.ref_logprobs[on_device] if inputs.ref_logprobs is not None else None
    mask, sampled = inputs.mask[on_device], inputs.sampled[on_device]
    is_weights = outside = sampler = None
    if inputs.sampler_logprobs is not None:  # [b, Lc] each; old is pi_old at the weights that start the update
        sampler = inputs.sampler_logprobs[on_device]
        is_weights, outside = sampler_importance_weights(old, sampler, sampled, s.sampler_is_cap,
                                                          s.sampler_is_mode, s.sampler_is_min)
    advantages = inputs.advantages[on_device]
    token_mask, entropy_mask = loss_token_masks(entropy, mask, advantages, logprobs,
                                                sampler if sampler is not None else old, s)
    loss, stats = policy_loss(
        logprobs, old, ref, advantages, mask, epsilon=s.epsilon, epsilon_high=s.epsilon_high,
        beta=s.beta, loss_type=s.loss_type, max_completion_length=s.max_completion_length,
        normalizer=inputs.global_tokens, importance_sampling_level=s.importance_sampling_level,
        sampler_weights=is_weights, kl_times_ratio=s.kl_times_ratio, loss_token_mask=token_mask, **s.objective)
    N = gen.completion_ids.shape[0]
    weight, _ = inputs.aggregation.micro_batch_weights(logprobs.shape[0], mask.sum(), N, inputs.total_tokens)
    weight = weight * inputs.rank_scale  # exact when 1.0: the ranks' shares are equal or not told apart
    bonus, kept = 0.0, None
    if s.entropy_bonus:  # a token mean whatever the loss type, weighted by the micro-batch's rows (TRL: 1 / GA)
        kept = mask if entropy_mask is None else mask * entropy_mask
        if coef > 0:
            bonus = coef * entropy_bonus(entropy, kept) * (logprobs.shape[0] / N) * inputs.rank_scale
        entropy = entropy.detach()
    reported = inputs.reported_logprobs[on_device] if inputs.reported_logprobs is not None else None
    router_aux = scored[2] if s.router is not None else None
    routing = 0.0 if router_aux is None else s.router.coef * router_aux * (logprobs.shape[0] / N) * inputs.rank_scale
    return MicroBatchLoss(loss, weight, stats, entropy, old, mask, sampled, is_weights, outside, sampler,
                          logprobs.detach(), reported, bonus, kept, router_aux, routing)
