"""The learner's half of a step: the clipped-surrogate update over a rollout batch in micro-batches with
gradient accumulation (plus the PTX micro-batch, if any); the optimizer and schedule it steps are
``grpo.parallel.optim``'s."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from grpo.algorithm import LogprobProcessing, loss_aggregation, policy_loss, sampler_importance_weights
from grpo.step.logprobs import DEVICE_DEFAULT_PASS, LogprobPass, completion_logprobs
from grpo.step.ptx import ptx_nll
from grpo.step.records import RolloutBatch, SftBatch, StepUpdate, UpdateStats
from grpo.parallel.distributed import DistInfo, all_reduce_sum
from grpo.parallel.learners import Learner


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


def rows_by_length(completion_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] row order for micro-batching: whole groups, the group whose longest completion is shortest
    first. Micro-batches of similar lengths carry less padding (``completion_logprobs`` skips columns
    that pad a whole micro-batch), and groups stay together so their prompt pass is still shared."""
    longest = completion_mask.sum(-1).view(-1, group_size).amax(-1)  # [P]
    groups = torch.argsort(longest, stable=True)  # [P]
    return (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).flatten()


def token_budget_micro_batches(order: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                               max_rows: int, max_tokens: int | str | None) -> list[torch.Tensor]:
    """``order`` [N] cut into micro-batches (row-index tensors, in order): ``max_rows`` rows each, or with
    ``max_tokens`` as many rows as keep rows x (longest prompt + longest completion among them), the padded
    width a log-prob pass runs, within ``max_tokens`` (and at most ``max_rows``); a row over the budget on its
    own forms a micro-batch alone. ``max_tokens="auto"``: the budget is the padded width of the largest
    ``max_rows``-row micro-batch, with no row limit: never more tokens in a pass than fixed rows would run,
    and fewer passes where short rows fill the room. ``order`` should be ``rows_by_length``'s, so that
    neighbours are alike."""
    if max_tokens is None or order.shape[0] == 0:
        return [order[start:start + max_rows] for start in range(0, order.shape[0], max_rows)]
    prompt_lengths = prompt_mask.sum(-1)[order].tolist()  # [N], real tokens (left padding is dropped per pass)
    completion_lengths = completion_mask.sum(-1)[order].tolist()  # [N]
    if max_tokens == "auto":
        max_tokens = max(len(p) * (max(p) + max(c)) for p, c in (
            (prompt_lengths[s:s + max_rows], completion_lengths[s:s + max_rows])
            for s in range(0, len(prompt_lengths), max_rows)))
        max_rows = len(prompt_lengths)
    cuts, start, widest_prompt, widest_completion = [], 0, 0, 0
    for i, (lp, lc) in enumerate(zip(prompt_lengths, completion_lengths)):
        wp, wc = max(widest_prompt, lp), max(widest_completion, lc)
        rows = i - start + 1
        if rows > 1 and (rows > max_rows or rows * (wp + wc) > max_tokens):
            cuts.append(i)
            start, wp, wc = i, lp, lc
        widest_prompt, widest_completion = wp, wc
    bounds = [0, *cuts, order.shape[0]]
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


_SUMMED = ("loss", "kl", "clip_fraction", "ratio_mean")  # statistics summed over micro-batches
# Token means over the first iteration (the sampler correction's weights are the same in every iteration).
_SAMPLER_IS = ("sampler_is/weight_mean", "sampler_is/capped_fraction", "sampler_is/logprob_diff")
# [loss, kl, clip_fraction, ratio_mean, entropy, loss/ptx, *_SAMPLER_IS]: one device tensor, so the step's
# statistics reach the host at once
_SLOTS = _SUMMED + ("entropy", "loss/ptx") + _SAMPLER_IS
_ENTROPY, _PTX = _SLOTS.index("entropy"), _SLOTS.index("loss/ptx")
# Each update's own statistics (UpdateStats' fields), one row per update, on the device until the step ends;
# the row min/max start at +-inf (no row yet) and become NaN if no row had tokens.
_UPDATE_SLOTS = ("loss", "kl", "entropy", "ratio_mean", "clip_low", "clip_high", "clip_region", "clip_units",
                 "clip_low_row_min", "clip_high_row_max")
_ROW_MIN, _ROW_MAX = _UPDATE_SLOTS.index("clip_low_row_min"), _UPDATE_SLOTS.index("clip_high_row_max")


def train_on_batch(learner: Learner, batch: RolloutBatch, s: LossSettings, dist_info: DistInfo,
                   ptx: SftBatch | None = None) -> StepUpdate:
    """``num_iterations`` optimizer updates on one rollout batch. Returns the step's training stats (means over
    its updates) and each update's own (``UpdateStats``, this rank's).

    A skipped update (non-finite gradient norm, see the learner) is counted in ``skipped_updates``. With
    ``s.sampler_is_mode`` each token's surrogate is weighted by ``sampler_importance_weights`` of the old
    log-probs (the batch's, else the first iteration's own) over ``batch.sampler_logprobs``; the weights'
    token mean, the share of tokens over the cap and the mean |old - sampler| are logged as ``sampler_is/*``.
    With a PTX micro-batch (``grpo.step.ptx``), each update also adds ``s.ptx_coef x`` its mean response NLL to
    the same gradient, before clipping and the optimizer step; ``loss/ptx`` is that NLL (unscaled), averaged
    over the updates. The same PTX micro-batch serves every iteration, as the rollout batch does.
    """
    gen = batch.generation
    N = gen.completion_ids.shape[0]
    # The rollout's per-row tensors may sit on the CPU (decoupled batches always do): the loss needs
    # them beside the log-probs, on the policy's device.
    device = next(learner.module.parameters()).device
    # [N, Lc]: every sampled token. Multi-turn, environment tokens are 0 (issue 27): the forward passes see
    # them (completion_mask), but the loss, its token counts, the KL, the entropy and the correction do not.
    sampled = gen.sampled_mask.float().to(device)
    mask = sampled  # [N, Lc]: the tokens that carry loss
    if s.mask_truncated_completions:  # DAPO: a cut-off completion's tokens teach nothing about its end
        mask = sampled * (~gen.truncated).to(device=device, dtype=sampled.dtype)[:, None]
    advantages = batch.advantages.to(device)  # [N]
    old_all = batch.old_logprobs.to(device) if batch.old_logprobs is not None else None  # [N, Lc]
    ref_all = batch.ref_logprobs.to(device) if batch.ref_logprobs is not None else None  # [N, Lc]
    sampler_all = None  # [N, Lc]: the sampler's own log-probs, for the correction
    if s.sampler_is_mode is not None:
        if batch.sampler_logprobs is None:
            raise ValueError("loss.sampler_is_correction is on but the rollout batch has no sampler log-probs: the "
                             "engine reported none (only a vLLM engine or a decoupled sampler does)")
        sampler_all = batch.sampler_logprobs.to(device)
    # dapo: the token count over all ranks; DDP averages gradients, so scale it back by the world size.
    total_tokens = mask.sum()
    aggregation = loss_aggregation(s.loss_type)  # how micro-batches add up to the batch's loss
    sampled_tokens = sampled.sum().clamp(min=1)
    # Clamped to its smallest non-zero value (1 token over all ranks): 0 when mask_truncated_completions
    # masked every completion, and the numerators are 0 then, so the loss is 0 instead of 0/0.
    world = dist_info.world_size
    global_tokens = (all_reduce_sum(total_tokens, dist_info) / world).clamp(min=1 / world)
    # The statistics stay on the device until the step ends: a float() per micro-batch would make the
    # host wait for the GPU to finish that micro-batch before it may queue the next one. float64, so that
    # the sums equal Python float sums of the fp32 terms (each converted to double, divided and summed).
    sums = torch.zeros(len(_SLOTS), dtype=torch.float64, device=device)  # see _SLOTS
    learning_rate = learner.lr  # the rate of this step's first update (the schedule moves in finish_update)
    grad_norms, skipped = [], 0
    per_update = torch.zeros(s.num_iterations, len(_UPDATE_SLOTS), dtype=torch.float64, device=device)
    per_update[:, _ROW_MIN], per_update[:, _ROW_MAX] = float("inf"), float("-inf")
    update_norms, update_rates, update_seconds = [], [], []
    # The gradient is a sum over rows, so which rows share a micro-batch changes nothing but padding.
    P = len(batch.prompts)
    max_tokens = s.max_tokens_per_micro_batch
    order = (rows_by_length(gen.completion_mask, N // P)
             if (N > s.micro_batch_size or max_tokens) and P and N % P == 0
             else torch.arange(N))  # [N]
    micro_batches = token_budget_micro_batches(order, gen.prompt_mask, gen.completion_mask, s.micro_batch_size,
                                               max_tokens)  # row indices, on the CPU
    # One copy to the device per step: a blocking host-to-device copy per micro-batch waits for the GPU.
    order_on_device = order.to(device)  # [N]
    # Without old log-probs from the rollout (colocated), the first iteration's own log-probs are
    # exactly the old policy's: no update has happened since sampling. They are kept for the later
    # iterations, which saves the separate forward pass over the batch that would compute the same.
    captured: list[torch.Tensor] | None = [] if old_all is None and s.num_iterations > 1 else None
    for iteration in range(s.num_iterations):
        start, update_started = 0, time.perf_counter()
        update_rates.append(learner.lr)
        this = per_update[iteration]  # [len(_UPDATE_SLOTS)]
        for index, rows in enumerate(micro_batches):  # rows on the CPU, like the rollout's tensors
            on_device = order_on_device[start:start + rows.shape[0]]
            start += rows.shape[0]
            # With PTX, its micro-batch closes the update: DDP must sync only after that last backward.
            with learner.accumulating(last=index == len(micro_batches) - 1 and ptx is None):
                # The entropy is read off this forward's logits (no pass of its own); the step's is the first
                # iteration's, whose weights are still the ones that sampled; each update logs its own (as TRL).
                first = iteration == 0
                result = completion_logprobs(learner.module, gen.prompt_ids[rows], gen.prompt_mask[rows],
                                             gen.completion_ids[rows], gen.completion_mask[rows], s.temperature,
                                             share_prompts=s.logprob_pass.share_prompts,
                                             column_bucket=s.logprob_pass.column_bucket,
                                             fused_head=s.logprob_pass.fused_head, pack=s.logprob_pass.pack,
                                             with_entropy=True, processing=s.processing)
                logprobs, entropy = result  # [b, Lc] each
                old = old_all[on_device] if old_all is not None else logprobs.detach()
                if captured is not None and iteration == 0:
                    captured.append(old)
                ref = ref_all[on_device] if ref_all is not None else None
                rows_mask = mask[on_device]
                is_weights = outside = None
                if sampler_all is not None:  # [b, Lc] each; old is pi_old at the weights that start the update
                    is_weights, outside = sampler_importance_weights(old, sampler_all[on_device],
                                                                      sampled[on_device], s.sampler_is_cap,
                                                                      s.sampler_is_mode, s.sampler_is_min)
                loss, stats = policy_loss(
                    logprobs, old, ref, advantages[on_device], rows_mask, epsilon=s.epsilon,
                    epsilon_high=s.epsilon_high, beta=s.beta, loss_type=s.loss_type,
                    max_completion_length=s.max_completion_length, normalizer=global_tokens,
                    importance_sampling_level=s.importance_sampling_level, sampler_weights=is_weights,
                    kl_times_ratio=s.kl_times_ratio)
                weight, _ = aggregation.micro_batch_weights(logprobs.shape[0], rows_mask.sum(), N, total_tokens)
                learner.backward(loss * weight)
            with torch.no_grad():
                # kl, clip_fraction and ratio_mean are token means within the micro-batch: weighted by its share of
                # the batch's tokens they are the batch's token means, however the rows were split
                token_share = (rows_mask.sum() / total_tokens.clamp(min=1)).double()
                terms = [(loss.detach() * weight).double()] + [stats[key].double() * token_share
                                                               for key in _SUMMED[1:]]
                sums[:len(_SUMMED)] += torch.stack(terms) / s.num_iterations
                entropy_part = ((entropy * sampled[on_device]).sum() / sampled_tokens).double()
                if first:  # token mean over every sampled token of the step
                    sums[_ENTROPY] += entropy_part
                this[:_ROW_MIN] += torch.stack([terms[0], terms[1], entropy_part, terms[3]] + [
                    stats[key].double() for key in ("clip_low", "clip_high", "clip_region", "clip_units")])
                this[_ROW_MIN] = torch.minimum(this[_ROW_MIN], stats["clip_low_row_min"].double())
                this[_ROW_MAX] = torch.maximum(this[_ROW_MAX], stats["clip_high_row_max"].double())
                if is_weights is not None and first:
                    real = sampled[on_device]  # [b, Lc]
                    gap = (old - sampler_all[on_device]).abs().masked_fill(real == 0, 0.0)  # padding may hold -inf
                    terms = torch.stack([(is_weights * real).sum(), (outside * real).sum(), gap.sum()])
                    sums[-len(_SAMPLER_IS):] += (terms / sampled_tokens).double()
        if ptx is not None:  # PaddleNLP's loss + ptx_coeff * ptx_loss, in one accumulated gradient
            with learner.accumulating(last=True):
                nll = ptx_nll(learner.module, ptx, s.logprob_pass)
                learner.backward(nll * s.ptx_coef)
            sums[_PTX] += nll.detach().double() / s.num_iterations
        if captured is not None and iteration == 0:
            old_all = torch.cat(captured)[torch.argsort(order).to(device)]  # [N, Lc], back in row order
        norm = learner.finish_update()  # the learner's one host sync per update (it decides the skip)
        update_norms.append(norm)
        update_seconds.append(time.perf_counter() - update_started)
        if norm is None:
            skipped += 1
        else:
            grad_norms.append(norm)
    per_update = per_update.masked_fill(per_update.isinf(), float("nan"))  # a bound never met: no row had tokens
    values = torch.cat([sums, per_update.flatten()]).tolist()  # the step's one transfer of its statistics
    totals = dict(zip(_SLOTS, values[:len(_SLOTS)]))
    width, flat = len(_UPDATE_SLOTS), values[len(_SLOTS):]
    rows = [flat[i * width:(i + 1) * width] for i in range(s.num_iterations)]
    if sampler_all is None:
        for name in _SAMPLER_IS:
            del totals[name]
    if ptx is None:
        del totals["loss/ptx"]
    totals["learning_rate"] = learning_rate
    totals["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    totals["skipped_updates"] = float(skipped)
    updates = [UpdateStats(**dict(zip(_UPDATE_SLOTS, row)), grad_norm=norm, learning_rate=rate, seconds=seconds)
               for row, norm, rate, seconds in zip(rows, update_norms, update_rates, update_seconds)]
    return StepUpdate(totals, updates)
