"""A rollout batch as the update reads it: the update's settings (``LossSettings``, built from the config by
``grpo.training.settings.loss_settings``), the batch's tensors on the policy's device with the token counts that
scale every micro-batch's loss (``LossInputs``), its micro-batches, and a step's mini-batches (one per update)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from grpo.algorithm import LogprobProcessing, LossAggregation, loss_aggregation
from grpo.models.moe import RouterLoss
from grpo.parallel.distributed import DistInfo, all_reduce_max, all_reduce_sum
from grpo.rollout.generation import Generation
from grpo.step.batching import mini_batches
from grpo.step.logprob_pass import DEVICE_DEFAULT_PASS, LogprobPass
from grpo.step.micro_batches import rows_by_length, token_budget_micro_batches
from grpo.step.records import RolloutBatch


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
    # train.mini_batches: optimizer updates per pass, each over its whole-group mini-batch (grpo.step.batching)
    mini_batches: int = 1
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
    adaptive_entropy: bool = False  # loss.adaptive_entropy: the coefficient is an EntropyControl's (train_on_batch)
    router: RouterLoss | None = None  # an MoE policy's load-balancing loss (loss.router_aux_loss_coef; None: none)
    routing_replay: bool = False  # loss.routing_replay: the passes route to the rollout's recorded experts
    routing_mismatch: bool = False  # log.routing_mismatch: the passes count where they route otherwise, no replay

    @property
    def entropy_bonus(self) -> bool:
        """The loss has an entropy bonus term (a fixed coefficient, or an adaptive one that may be 0 for now)."""
        return self.entropy_coef > 0 or self.adaptive_entropy


@dataclass
class LossInputs:
    """A rollout batch (one update's: the step's, or one of its mini-batches) as the update reads it: its per-row
    tensors on the policy's device (the rollout's may sit on the CPU; decoupled batches always do), the token
    counts that scale every micro-batch's loss, and the micro-batches.

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
              so the loss is 0 instead of 0/0. Of a mini-batch: the step's loss tokens over all ranks / (world
              size x mini-batches) (``prepare_mini_batches``).
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


def prepare_mini_batches(batch: RolloutBatch, s: LossSettings, dist_info: DistInfo,
                         device: torch.device) -> list[LossInputs]:
    """``prepare_batch`` of each of the step's ``s.mini_batches`` mini-batches (``grpo.step.batching.mini_batches``;
    the batch itself when 1). Each update's loss is its mini-batch's own, but with a token normaliser that is the
    step's (dapo's ``global_tokens``): its loss tokens over all ranks / (world size x mini-batches), TRL's
    ``num_items_in_batch`` of the generation rescaled to one update (``GRPOTrainer._compute_loss``), so that an
    update with more tokens weighs more and the updates' losses at equal weights average to the step's."""
    parts = [prepare_batch(part, s, dist_info, device) for part in mini_batches(batch, s.mini_batches)]
    if len(parts) == 1:
        return parts
    step_tokens = all_reduce_sum(torch.stack([part.total_tokens for part in parts]).sum(), dist_info)  # one collective
    per_update = step_tokens.clamp(min=1) / (dist_info.world_size * len(parts))
    return [replace(part, global_tokens=per_update) for part in parts]
