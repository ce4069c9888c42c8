"""The learner's half of a step: the clipped-surrogate updates over a rollout batch, ``num_iterations`` passes
of ``mini_batches`` optimizer updates each, every update over its mini-batch in micro-batches with gradient
accumulation (plus the PTX micro-batch, if any); the batch as the update reads it is ``grpo.step.update_inputs``',
a micro-batch's loss ``grpo.step.micro_batch_loss``', the optimizer and schedule it steps ``grpo.parallel.optim``'s,
the statistics ``grpo.step.update_stats``'."""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from grpo.algorithm import entropy_sums
from grpo.models.routing_replay import Replaying
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import Learner
from grpo.step.entropy_control import EntropyControl
from grpo.step.logprobs import completion_logprobs
from grpo.step.micro_batch_loss import micro_batch_loss
from grpo.step.ptx import ptx_nll
from grpo.step.records import RolloutBatch, SftBatch, StepUpdate
from grpo.step.update_inputs import LossInputs, LossSettings, prepare_mini_batches
from grpo.step.update_stats import StepStats


def start_logprobs(module: torch.nn.Module, inputs: LossInputs, s: LossSettings) -> torch.Tensor:
    """[N, Lc] the mini-batch's log-probs under ``module`` as it is, without gradients: its old log-probs when it
    has none and an update of the step comes before its first pass (the weights must be the step's start)."""
    gen, lp = inputs.generation, s.logprob_pass
    replaying = replaying_for(module, inputs, s)
    with torch.no_grad(), replaying.hooks() if replaying is not None else nullcontext():
        return completion_logprobs(module, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask,
                                   s.temperature, s.micro_batch_size, share_prompts=lp.share_prompts,
                                   column_bucket=lp.column_bucket, processing=s.processing, fused_head=lp.fused_head,
                                   pack=lp.pack, routing=gen.routing, replaying=replaying)


def replaying_for(module: torch.nn.Module, inputs: LossInputs, s: LossSettings) -> Replaying | None:
    """Routing replay's hooks for ``module``'s passes over ``inputs`` (``loss.routing_replay`` with the rollout's
    recorded experts; ``log.routing_mismatch``: hooks that only count), else None."""
    if not (s.routing_replay or s.routing_mismatch):
        return None
    if inputs.generation.routing is None:
        raise RuntimeError("loss.routing_replay / log.routing_mismatch: the batch carries no recorded routing (its "
                           "engine did not record it)")
    return Replaying(module, apply=s.routing_replay)


def policy_backward(learner: Learner, inputs: LossInputs, old_logprobs: torch.Tensor | None, s: LossSettings,
                    stats: StepStats, update: int, closes_update: bool, keep_old: bool,
                    entropy: EntropyControl | None = None) -> list[torch.Tensor]:
    """Update ``update``'s backward passes over its batch, one per micro-batch; ``closes_update``: the last
    one lets DDP sync (not when a PTX micro-batch follows). Returns the old log-probs each micro-batch used
    (in micro-batch order) when ``keep_old``, else []. ``entropy``: the adaptive bonus's controller (its
    coefficient for every micro-batch; each adds the entropy its bonus acted on to the update's window).

    Ranks may run different numbers of micro-batches (a token budget, uneven partial-rollout steps): under
    ``no_sync`` DDP neither all-reduces nor syncs buffers, so ranks meet once per update, in the first forward
    and the last backward (tested at 3 against 2: tests/test_uneven_ranks.py). Under DeepSpeed, whose ZeRO-2/3
    reduce in every backward, a rank with fewer then runs ``inputs.padding`` micro-batches of zero gradient
    (tests/test_uneven_deepspeed.py)."""
    olds, count = [], len(inputs.micro_batches) + inputs.padding
    replaying = replaying_for(learner.module, inputs, s)
    # routing replay's hooks stay open through each backward: gradient checkpointing re-routes the layers there
    with replaying.hooks() if replaying is not None else nullcontext():
        for index, (rows, on_device) in enumerate(inputs.micro_batches):
            with learner.accumulating(last=closes_update and index == count - 1):
                part = micro_batch_loss(learner.module, inputs, rows, on_device, old_logprobs, s,
                                        entropy.coef() if entropy is not None else None, replaying)
                learner.backward(part.objective)
            stats.add_micro_batch(part, inputs, update)
            if entropy is not None:
                entropy.add(entropy_sums(part.entropy, part.bonus_mask))
            if keep_old:
                olds.append(part.old)
        for index in range(len(inputs.micro_batches), count):
            with learner.accumulating(last=closes_update and index == count - 1):
                # one row's loss with weight 0: the forward and backward (and ZeRO's collectives) without a gradient
                rows, on_device = inputs.micro_batches[0]
                part = micro_batch_loss(learner.module, inputs, rows[:1], on_device[:1], old_logprobs, s,
                                        entropy.coef() if entropy is not None else None, replaying)
                learner.backward(part.objective * 0.0)
    if replaying is not None:
        stats.add_routing(replaying)
    return olds


def ptx_backward(learner: Learner, ptx: SftBatch, s: LossSettings, stats: StepStats) -> None:
    """The PTX micro-batch's backward, closing the update: PaddleNLP's loss + ptx_coeff * ptx_loss, in one
    accumulated gradient."""
    with learner.accumulating(last=True):
        nll = ptx_nll(learner.module, ptx, s.logprob_pass)
        learner.backward(nll * s.ptx_coef)
    stats.add_ptx(nll)


def train_on_batch(learner: Learner, batch: RolloutBatch, s: LossSettings, dist_info: DistInfo,
                   ptx: SftBatch | None = None, entropy: EntropyControl | None = None) -> StepUpdate:
    """``num_iterations x mini_batches`` optimizer updates on one rollout batch: each pass over it is one update per
    mini-batch (``prepare_mini_batches``), every ratio to the weights that started the step. Returns the step's
    training stats (means over its updates) and each update's own (``UpdateStats``, this rank's).

    A skipped update (non-finite gradient norm, see the learner) is counted in ``skipped_updates``; under fp16
    ``fp16/overflow_updates`` counts those the loss scaler skipped, and ``fp16/loss_scale`` is its scale. With
    ``s.sampler_is_mode`` each token's surrogate is weighted by ``sampler_importance_weights`` of the old
    log-probs (the batch's, else the step's start) over ``batch.sampler_logprobs``; the weights' token mean, the
    share of tokens over the cap and the mean |old - sampler| are logged as ``sampler_is/*``. When the batch
    carries the sampling side's log-probs (``LossInputs.reported_logprobs``), the first update's mismatch with
    them is logged as ``mismatch/*`` (``grpo.algorithm.mismatch_sums``).
    With a PTX micro-batch (``grpo.step.ptx``), each update also adds ``s.ptx_coef x`` its mean response NLL to
    the same gradient, before clipping and the optimizer step; ``loss/ptx`` is that NLL (unscaled), averaged
    over the updates. The same PTX micro-batch serves every update, as the rollout batch serves every pass.
    ``entropy``: with ``s.adaptive_entropy``, the run's controller of the bonus's coefficient, stepped after every
    update (its state moves: it is the run's, checkpointed by the loop).
    """
    device = next(learner.module.parameters()).device
    parts = prepare_mini_batches(batch, s, dist_info, device)
    first = parts[0]
    sampled_tokens = (None if len(parts) == 1  # the first pass's denominators: the step's sampled tokens
                      else torch.stack([part.sampled.sum() for part in parts]).sum().clamp(min=1))
    stats = StepStats(s.num_iterations, device, first.sampler_logprobs is not None, ptx is not None,
                      mismatch=first.reported_logprobs is not None, mini_batches=len(parts),
                      sampled_tokens=sampled_tokens)
    first_rate = learner.lr  # the rate of this step's first update (the schedule moves in finish_update)
    # Without old log-probs from the rollout (colocated), the first update's own log-probs are exactly the old
    # policy's: no update has happened since sampling. A later mini-batch's must be taken before that update
    # moves the weights: one no-grad pass over each, now.
    olds = [part.old_logprobs if index == 0 or part.old_logprobs is not None
            else start_logprobs(learner.module, part, s) for index, part in enumerate(parts)]
    for iteration in range(s.num_iterations):
        for index, inputs in enumerate(parts):
            olds[index] = one_update(learner, inputs, olds[index], s, stats, iteration * len(parts) + index, ptx,
                                     dist_info, entropy)
    return stats.result(first_rate)


def one_update(learner: Learner, inputs: LossInputs, old: torch.Tensor | None, s: LossSettings, stats: StepStats,
               update: int, ptx: SftBatch | None, dist_info: DistInfo,
               entropy: EntropyControl | None = None) -> torch.Tensor | None:
    """Optimizer update ``update`` of the step, over ``inputs`` (and the PTX micro-batch, if any); ``old``: its
    [N, Lc] old log-probs, or None when its own forward is the old policy's (no update of the step came before).
    Returns the old log-probs its batch's later passes use."""
    started, rate = time.perf_counter(), learner.lr
    # A first pass that is its own old policy keeps its log-probs for the later passes, which saves the separate
    # forward pass over the batch that would compute the same.
    keep_old = old is None and s.num_iterations > 1
    kept = policy_backward(learner, inputs, old, s, stats, update, closes_update=ptx is None, keep_old=keep_old,
                           entropy=entropy)
    if ptx is not None:
        ptx_backward(learner, ptx, s, stats)
    if keep_old:
        old = inputs.in_row_order(kept)  # [N, Lc]
    outcome = learner.finish_update()  # the learner's one host sync per update (it decides the skip)
    coef = (entropy.end_update(dist_info) if entropy is not None  # the adaptive bonus's host read, after the sync
            else s.entropy_coef if s.entropy_bonus else None)
    stats.end_update(outcome, rate, time.perf_counter() - started, coef)
    return old
