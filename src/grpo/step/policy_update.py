"""The learner's half of a step: the clipped-surrogate update over a rollout batch in micro-batches with
gradient accumulation (plus the PTX micro-batch, if any); the optimizer and schedule it steps are
``grpo.parallel.optim``'s."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from grpo.algorithm import (
    LogprobProcessing,
    LossAggregation,
    entropy_bonus,
    high_entropy_mask,
    loss_aggregation,
    mismatch_sums,
    off_policy_mask,
    policy_loss,
    sampler_importance_weights,
)
from grpo.parallel.distributed import DistInfo, all_reduce_max, all_reduce_sum
from grpo.parallel.learners import Learner, UpdateOutcome
from grpo.rollout.generation import Generation
from grpo.step.logprobs import DEVICE_DEFAULT_PASS, LogprobPass, completion_logprobs
from grpo.step.micro_batches import rows_by_length, token_budget_micro_batches
from grpo.step.ptx import ptx_nll
from grpo.step.records import RolloutBatch, SftBatch, StepUpdate, UpdateStats


@dataclass(frozen=True)
class LossSettings:
    epsilon: float
    epsilon_high: float | None
    beta: float
    loss_type: str
    max_completion_length: int
    temperature: float
    num_iterations: int
    micro_batch_size: int
    max_grad_norm: float | None
    importance_sampling_level: str = "token"  # or "sequence" (GSPO), see grpo.algorithm.policy_loss
    mask_truncated_completions: bool = False  # DAPO: completions without EOS get no loss
    kl_times_ratio: bool = False  # loss.kl_times_ratio (TRL's use_bias_correction_kl)
    sampler_is_mode: str | None = None  # loss.sampler_is_correction on: a name in grpo.algorithm.SAMPLER_CORRECTIONS
    sampler_is_cap: float = 3.0
    sampler_is_min: float | None = None  # loss.sampler_is_min: the weights' lower bound (None: none)
    processing: LogprobProcessing | None = None  # the sampling controls the log-probs follow (None: off)
    ptx_coef: float = 0.0  # weight of the PTX micro-batch's mean NLL in each update (ptx.coef)
    logprob_pass: LogprobPass = DEVICE_DEFAULT_PASS  # how the update's log-prob passes run (None fields: the device's default)
    # micro-batches by padded tokens: N, "auto" (token_budget_micro_batches) or None (rows); decided for the run's
    # device and learner by grpo.training.settings.micro_batch_tokens
    max_tokens_per_micro_batch: int | str | None = None
    # Ranks hold different shares of a step (decoupled partial rollouts): each rank's loss is scaled by
    # LossAggregation.rank_scale to make the update the whole step's (bnpo's too, else per rank as TRL's).
    uneven_ranks: bool = False
    # Every rank runs as many micro-batches as the rank with the most (padding ones add a zero gradient): ZeRO-2/3
    # reduce gradients inside each backward, so under DeepSpeed uneven counts would mismatch the collectives.
    equal_micro_batches: bool = False
    objective: dict = field(default_factory=dict)  # policy_loss's keywords of the loss type: delta, sapo_*, vespo_*
    top_entropy_quantile: float = 1.0  # loss.top_entropy_quantile: the share of a micro-batch's tokens that keep loss
    off_policy_mask_threshold: float | None = None  # loss.off_policy_mask_threshold (None: off)
    entropy_coef: float = 0.0  # loss.entropy_coef: the entropy bonus (its gradient through the tempered logits)


# Token means within a micro-batch, weighted by its share of the batch's loss tokens into the batch's.
_TOKEN_MEANS = ("kl", "clip_fraction", "ratio_mean")
# Token means over the first iteration (the sampler correction's weights are the same in every iteration).
_SAMPLER_IS = ("sampler_is/weight_mean", "sampler_is/capped_fraction", "sampler_is/logprob_diff")
# The sampler/trainer mismatch (grpo.algorithm.mismatch), first iteration: k3 and the masked share are token
# means, ratio_max the largest ratio (a maximum over ranks too: grpo.step.metrics.RANK_MAXIMA).
_MISMATCH = ("mismatch/k3", "mismatch/ratio_max", "mismatch/masked_fraction")
_CLIP_COUNTS = ("clip_low", "clip_high", "clip_region", "clip_units")  # summed per update (grpo.algorithm.clipping)


@dataclass
class LossInputs:
    """A rollout batch as the update reads it: its per-row tensors on the policy's device (the rollout's may
    sit on the CPU; decoupled batches always do), the token counts that scale every micro-batch's loss, and
    the micro-batches.

    sampled:  [N, Lc] float, every sampled token. Multi-turn, the environment's tokens are 0: the forward
              passes see them (completion_mask), but the loss, its token counts, the KL, the entropy and
              the sampler correction do not.
    mask:     [N, Lc] float, the tokens that carry loss (``sampled``, less truncated completions with
              ``mask_truncated_completions``).
    advantages: [N] or [N, Lc]; old_logprobs, ref_logprobs, sampler_logprobs: [N, Lc] or None.
    reported_logprobs: [N, Lc] the sampling side's own log-probs of the tokens, for the mismatch metrics: the
              batch's ``sampler_logprobs``, else its ``old_logprobs`` (taken where it was sampled); None when
              the update's own first pass is pi_old (colocated), with nothing to compare.
    total_tokens: 0-d, this rank's loss tokens; sampled_tokens: 0-d, its sampled tokens (at least 1);
    global_tokens: 0-d, the loss tokens over all ranks / world size (DDP averages gradients), at least
              1 token over all ranks: 0 when every completion was masked, and the numerators are 0 then,
              so the loss is 0 instead of 0/0.
    rank_scale: 0-d or 1.0, the factor on this rank's loss (``LossSettings.uneven_ranks``: its rows' or
              tokens' share, ``LossAggregation.rank_scale``; 1.0 otherwise).
    order:    [N] the row order of the micro-batches (CPU); micro_batches: (rows on the CPU, like the
              rollout's tensors; the same rows on the policy's device) per micro-batch, in order.
    padding:  the zero-gradient micro-batches this rank runs after its own (``LossSettings.equal_micro_batches``:
              the most micro-batches of any rank less its own; 0 otherwise).
    """

    generation: Generation
    sampled: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    sampler_logprobs: torch.Tensor | None
    reported_logprobs: torch.Tensor | None
    total_tokens: torch.Tensor
    sampled_tokens: torch.Tensor
    global_tokens: torch.Tensor
    aggregation: LossAggregation
    order: torch.Tensor
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    rank_scale: torch.Tensor | float = 1.0
    padding: int = 0

    def in_row_order(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """[N, ...] the micro-batches' ``parts`` (in micro-batch order) put back in the batch's row order."""
        return torch.cat(parts)[torch.argsort(self.order).to(parts[0].device)]


def prepare_batch(batch: RolloutBatch, s: LossSettings, dist_info: DistInfo, device: torch.device) -> LossInputs:
    """The update's ``LossInputs`` for ``batch`` on ``device``; its collectives: the global token count, and
    the ranks' most micro-batches with ``s.equal_micro_batches``."""
    gen = batch.generation
    N = gen.completion_ids.shape[0]
    sampled = gen.sampled_mask.float().to(device)  # [N, Lc]
    mask = sampled  # [N, Lc]
    if s.mask_truncated_completions:  # DAPO: a cut-off completion's tokens teach nothing about its end
        mask = sampled * (~gen.truncated).to(device=device, dtype=sampled.dtype)[:, None]
    sampler_logprobs = None  # [N, Lc]: the sampler's own log-probs, for the correction
    if s.sampler_is_mode is not None:
        if batch.sampler_logprobs is None:
            raise ValueError("loss.sampler_is_correction is on but the rollout batch has no sampler log-probs: the "
                             "engine reported none (only a vLLM engine or a decoupled sampler does)")
        sampler_logprobs = batch.sampler_logprobs.to(device)
    reported = batch.sampler_logprobs if batch.sampler_logprobs is not None else batch.old_logprobs
    total_tokens = mask.sum()
    aggregation = loss_aggregation(s.loss_type)  # how micro-batches add up to the batch's loss
    world = dist_info.world_size
    rank_scale = 1.0
    if s.uneven_ranks:  # the rows over all ranks ride along in the one collective
        means = all_reduce_sum(torch.stack([total_tokens, total_tokens.new_tensor(float(N))]), dist_info) / world
        global_tokens = means[0].clamp(min=1 / world)
        rank_scale = aggregation.rank_scale(N, means[1], total_tokens, global_tokens)
    else:
        global_tokens = (all_reduce_sum(total_tokens, dist_info) / world).clamp(min=1 / world)
    # The gradient is a sum over rows, so which rows share a micro-batch changes nothing but padding.
    P = len(batch.prompts)
    max_tokens = s.max_tokens_per_micro_batch
    order = (rows_by_length(gen.completion_mask, N // P)
             if (N > s.micro_batch_size or max_tokens) and P and N % P == 0
             else torch.arange(N))  # [N]
    micro_batches = token_budget_micro_batches(order, gen.prompt_mask, gen.completion_mask, s.micro_batch_size,
                                               max_tokens)  # row indices, on the CPU
    # One copy to the device per step: a blocking host-to-device copy per micro-batch waits for the GPU.
    order_on_device, start, pairs = order.to(device), 0, []  # [N]
    for rows in micro_batches:
        pairs.append((rows, order_on_device[start:start + rows.shape[0]]))
        start += rows.shape[0]
    padding = 0
    if s.equal_micro_batches:  # the count is the step's: every update of it runs the same micro-batches
        most = all_reduce_max(torch.tensor(len(pairs), device=device), dist_info)
        padding = int(most) - len(pairs)
    return LossInputs(
        gen, sampled, mask, batch.advantages.to(device),
        batch.old_logprobs.to(device) if batch.old_logprobs is not None else None,
        batch.ref_logprobs.to(device) if batch.ref_logprobs is not None else None,
        sampler_logprobs, reported.to(device) if reported is not None else None, total_tokens, sampled.sum().clamp(min=1), global_tokens, aggregation, order, pairs,
        rank_scale=rank_scale, padding=padding)


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
    reported: [b, Lc] the rows' ``LossInputs.reported_logprobs`` (None: none).
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

    @property
    def objective(self) -> torch.Tensor:
        """What backward runs on: the weighted policy loss less the weighted entropy bonus."""
        return self.loss * self.weight - self.bonus


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
                     old_logprobs: torch.Tensor | None, s: LossSettings) -> MicroBatchLoss:
    """The clipped-surrogate loss of the batch's ``rows`` (CPU indices; ``on_device``: the same on the
    policy's device) under ``module``. ``old_logprobs`` [N, Lc], or None: the pass's own, detached (the
    first iteration's weights are still the ones that sampled)."""
    gen = inputs.generation
    lp = s.logprob_pass
    # The entropy is read off this forward's logits (no pass of its own).
    logprobs, entropy = completion_logprobs(module, gen.prompt_ids[rows], gen.prompt_mask[rows],
                                            gen.completion_ids[rows], gen.completion_mask[rows], s.temperature,
                                            share_prompts=lp.share_prompts, column_bucket=lp.column_bucket,
                                            fused_head=lp.fused_head, pack=lp.pack, with_entropy=True,
                                            processing=s.processing, entropy_grad=s.entropy_coef > 0)  # [b, Lc] each
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
    bonus = 0.0
    if s.entropy_coef > 0:  # a token mean whatever the loss type, weighted by the micro-batch's rows (TRL: 1 / GA)
        kept = mask if entropy_mask is None else mask * entropy_mask
        bonus = s.entropy_coef * entropy_bonus(entropy, kept) * (logprobs.shape[0] / N) * inputs.rank_scale
        entropy = entropy.detach()
    reported = inputs.reported_logprobs[on_device] if inputs.reported_logprobs is not None else None
    return MicroBatchLoss(loss, weight, stats, entropy, old, mask, sampled, is_weights, outside, sampler,
                          logprobs.detach(), reported, bonus)


class StepStats:
    """A step's statistics, summed by name as float64 0-d tensors on the policy's device until the step ends:
    a float() per micro-batch would make the host wait for the GPU to finish that micro-batch before it may
    queue the next one. float64, so that the sums equal Python float sums of the fp32 terms (each converted
    to double, divided and summed). ``result`` brings them all to the host in one transfer.

    ``totals``: the step's (means over its updates; the entropy and ``sampler_is/*`` the first iteration's,
    whose weights are still the ones that sampled); ``updates``: each update's own, by ``UpdateStats``'
    field names, the row min/max starting at +-inf (no row yet).
    """

    def __init__(self, num_iterations: int, device: torch.device, sampler_is: bool, ptx: bool, mismatch: bool = False):
        def zero() -> torch.Tensor:
            return torch.zeros((), dtype=torch.float64, device=device)

        def bound(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=torch.float64, device=device)

        names = ("loss", *_TOKEN_MEANS, "entropy", *(("loss/ptx",) if ptx else ()),
                 *(_SAMPLER_IS if sampler_is else ()), *(_MISMATCH if mismatch else ()))
        self.num_iterations = num_iterations
        self.totals = {name: zero() for name in names}
        self.updates = [{**{name: zero() for name in ("loss", "kl", "entropy", "ratio_mean", *_CLIP_COUNTS)},
                         "clip_low_row_min": bound(float("inf")), "clip_high_row_max": bound(float("-inf"))}
                        for _ in range(num_iterations)]
        self.grad_norms: list[float | None] = []
        self.learning_rates: list[float] = []
        self.seconds: list[float] = []
        self.overflows = 0  # updates fp16's loss scaler skipped (UpdateOutcome.overflow)
        self.loss_scale: float | None = None  # fp16: the scale after the step's last update

    @torch.no_grad()
    def add_micro_batch(self, part: MicroBatchLoss, inputs: LossInputs, iteration: int) -> None:
        """Add one micro-batch of update ``iteration``."""
        totals, update, n = self.totals, self.updates[iteration], self.num_iterations
        # kl, clip_fraction and ratio_mean are token means within the micro-batch: weighted by its share of the
        # batch's tokens they are the batch's token means, however the rows were split
        token_share = (part.mask.sum() / inputs.total_tokens.clamp(min=1)).double()
        loss = part.objective.detach().double()
        means = {key: part.stats[key].double() * token_share for key in _TOKEN_MEANS}
        totals["loss"] += loss / n
        for key, value in means.items():
            totals[key] += value / n
        entropy = ((part.entropy * part.sampled).sum() / inputs.sampled_tokens).double()
        if iteration == 0:  # token mean over every sampled token of the step
            totals["entropy"] += entropy
        for key, value in (("loss", loss), ("kl", means["kl"]), ("entropy", entropy),
                           ("ratio_mean", means["ratio_mean"])):
            update[key] += value
        for key in _CLIP_COUNTS:
            update[key] += part.stats[key].double()
        update["clip_low_row_min"] = torch.minimum(update["clip_low_row_min"], part.stats["clip_low_row_min"].double())
        update["clip_high_row_max"] = torch.maximum(update["clip_high_row_max"],
                                                    part.stats["clip_high_row_max"].double())
        if part.is_weights is not None and iteration == 0:
            gap = (part.old - part.sampler).abs().masked_fill(part.sampled == 0, 0.0)  # padding may hold -inf
            for key, summed in zip(_SAMPLER_IS, ((part.is_weights * part.sampled).sum(),
                                                 (part.outside * part.sampled).sum(), gap.sum())):
                totals[key] += (summed / inputs.sampled_tokens).double()
        if part.reported is not None and iteration == 0:  # the weights that start the update vs the sampler's
            sums = mismatch_sums(part.current, part.reported, part.sampled, part.is_weights)
            totals["mismatch/k3"] += sums.k3 / inputs.sampled_tokens.double()
            totals["mismatch/masked_fraction"] += sums.masked / inputs.sampled_tokens.double()
            totals["mismatch/ratio_max"] = torch.maximum(totals["mismatch/ratio_max"], sums.ratio_max)

    def add_ptx(self, nll: torch.Tensor) -> None:
        self.totals["loss/ptx"] += nll.detach().double() / self.num_iterations

    def end_update(self, outcome: UpdateOutcome, learning_rate: float, seconds: float) -> None:
        """The update's host values: what the learner did (its gradient norm, None: skipped; fp16's loss scale),
        its rate and wall time."""
        self.grad_norms.append(outcome.grad_norm)
        self.learning_rates.append(learning_rate)
        self.seconds.append(seconds)
        self.overflows += outcome.overflow
        if outcome.loss_scale is not None:
            self.loss_scale = outcome.loss_scale

    def result(self, learning_rate: float) -> StepUpdate:
        """The step's ``StepUpdate``; ``learning_rate``: its first update's."""
        named = [*self.totals.values(), *(value for update in self.updates for value in update.values())]
        values = iter(torch.stack(named).tolist())  # the step's one transfer of its statistics
        totals = {name: next(values) for name in self.totals}
        nan_if_inf = (lambda v: float("nan") if math.isinf(v) else v)  # a bound never met: no row had tokens
        rows = [{name: nan_if_inf(next(values)) for name in update} for update in self.updates]
        norms = [norm for norm in self.grad_norms if norm is not None]
        totals["learning_rate"] = learning_rate
        totals["grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
        totals["skipped_updates"] = float(len(self.grad_norms) - len(norms))
        if self.loss_scale is not None:  # fp16: the overflow skips among them (not counted by SkipGuard)
            totals.update({"fp16/loss_scale": self.loss_scale, "fp16/overflow_updates": float(self.overflows)})
        return StepUpdate(totals, [UpdateStats(**row, grad_norm=norm, learning_rate=rate, seconds=seconds)
                                   for row, norm, rate, seconds in zip(rows, self.grad_norms, self.learning_rates,
                                                                       self.seconds)])


def policy_backward(learner: Learner, inputs: LossInputs, old_logprobs: torch.Tensor | None, s: LossSettings,
                    stats: StepStats, iteration: int, closes_update: bool, keep_old: bool) -> list[torch.Tensor]:
    """Update ``iteration``'s backward passes over the batch, one per micro-batch; ``closes_update``: the last
    one lets DDP sync (not when a PTX micro-batch follows). Returns the old log-probs each micro-batch used
    (in micro-batch order) when ``keep_old``, else [].

    Ranks may run different numbers of micro-batches (a token budget, uneven partial-rollout steps): under
    ``no_sync`` DDP neither all-reduces nor syncs buffers, so ranks meet once per update, in the first forward
    and the last backward (tested at 3 against 2: tests/test_uneven_ranks.py). Under DeepSpeed, whose ZeRO-2/3
    reduce in every backward, a rank with fewer then runs ``inputs.padding`` micro-batches of zero gradient
    (tests/test_uneven_deepspeed.py)."""
    olds, count = [], len(inputs.micro_batches) + inputs.padding
    for index, (rows, on_device) in enumerate(inputs.micro_batches):
        with learner.accumulating(last=closes_update and index == count - 1):
            part = micro_batch_loss(learner.module, inputs, rows, on_device, old_logprobs, s)
            learner.backward(part.objective)
        stats.add_micro_batch(part, inputs, iteration)
        if keep_old:
            olds.append(part.old)
    for index in range(len(inputs.micro_batches), count):
        with learner.accumulating(last=closes_update and index == count - 1):
            # one row's loss with weight 0: the forward and backward (and ZeRO's collectives) without a gradient
            rows, on_device = inputs.micro_batches[0]
            part = micro_batch_loss(learner.module, inputs, rows[:1], on_device[:1], old_logprobs, s)
            learner.backward(part.objective * 0.0)
    return olds


def ptx_backward(learner: Learner, ptx: SftBatch, s: LossSettings, stats: StepStats) -> None:
    """The PTX micro-batch's backward, closing the update: PaddleNLP's loss + ptx_coeff * ptx_loss, in one
    accumulated gradient."""
    with learner.accumulating(last=True):
        nll = ptx_nll(learner.module, ptx, s.logprob_pass)
        learner.backward(nll * s.ptx_coef)
    stats.add_ptx(nll)


def train_on_batch(learner: Learner, batch: RolloutBatch, s: LossSettings, dist_info: DistInfo,
                   ptx: SftBatch | None = None) -> StepUpdate:
    """``num_iterations`` optimizer updates on one rollout batch. Returns the step's training stats (means over
    its updates) and each update's own (``UpdateStats``, this rank's).

    A skipped update (non-finite gradient norm, see the learner) is counted in ``skipped_updates``; under fp16
    ``fp16/overflow_updates`` counts those the loss scaler skipped, and ``fp16/loss_scale`` is its scale. With
    ``s.sampler_is_mode`` each token's surrogate is weighted by ``sampler_importance_weights`` of the old
    log-probs (the batch's, else the first iteration's own) over ``batch.sampler_logprobs``; the weights'
    token mean, the share of tokens over the cap and the mean |old - sampler| are logged as ``sampler_is/*``.
    When the batch carries the sampling side's log-probs (``LossInputs.reported_logprobs``), the first pass's
    mismatch with them is logged as ``mismatch/*`` (``grpo.algorithm.mismatch_sums``).
    With a PTX micro-batch (``grpo.step.ptx``), each update also adds ``s.ptx_coef x`` its mean response NLL to
    the same gradient, before clipping and the optimizer step; ``loss/ptx`` is that NLL (unscaled), averaged
    over the updates. The same PTX micro-batch serves every iteration, as the rollout batch does.
    """
    device = next(learner.module.parameters()).device
    inputs = prepare_batch(batch, s, dist_info, device)
    stats = StepStats(s.num_iterations, device, inputs.sampler_logprobs is not None, ptx is not None,
                      mismatch=inputs.reported_logprobs is not None)
    first_rate = learner.lr  # the rate of this step's first update (the schedule moves in finish_update)
    old = inputs.old_logprobs
    for iteration in range(s.num_iterations):
        started, rate = time.perf_counter(), learner.lr
        # Without old log-probs from the rollout (colocated), the first iteration's own log-probs are exactly
        # the old policy's: no update has happened since sampling. They are kept for the later iterations,
        # which saves the separate forward pass over the batch that would compute the same.
        keep_old = old is None and s.num_iterations > 1
        olds = policy_backward(learner, inputs, old, s, stats, iteration, closes_update=ptx is None,
                               keep_old=keep_old)
        if ptx is not None:
            ptx_backward(learner, ptx, s, stats)
        if keep_old:
            old = inputs.in_row_order(olds)  # [N, Lc]
        outcome = learner.finish_update()  # the learner's one host sync per update (it decides the skip)
        stats.end_update(outcome, rate, time.perf_counter() - started)
    return stats.result(first_rate)
