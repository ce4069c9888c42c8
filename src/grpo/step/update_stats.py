"""A step's training statistics as its updates' micro-batches produce them (``StepStats``): summed on the policy's
device, brought to the host once per step as a ``StepUpdate`` (the step's means and each update's own)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from grpo.algorithm import mismatch_sums
from grpo.step.records import StepUpdate, UpdateStats

if TYPE_CHECKING:  # annotations only (a record of each: no logic of theirs is called)
    from grpo.models.routing_replay import Replaying
    from grpo.parallel.update_outcome import UpdateOutcome
    from grpo.step.micro_batch_loss import MicroBatchLoss
    from grpo.step.update_inputs import LossInputs

# Token means within a micro-batch, weighted by its share of the update's loss tokens into the update's.
TOKEN_MEANS = ("kl", "clip_fraction", "ratio_mean")
# Token means over the first pass (the sampler correction's weights are the same in every pass).
SAMPLER_IS = ("sampler_is/weight_mean", "sampler_is/capped_fraction", "sampler_is/logprob_diff")
# The sampler/trainer mismatch (grpo.algorithm.mismatch), first update: k3 and the masked share are token
# means, ratio_max the largest ratio (a maximum over ranks too: grpo.step.metrics.RANK_MAXIMA).
MISMATCH = ("mismatch/k3", "mismatch/ratio_max", "mismatch/masked_fraction")
CLIP_COUNTS = ("clip_low", "clip_high", "clip_region", "clip_units")  # summed per update (grpo.algorithm.clipping)


class StepStats:
    """A step's statistics, summed by name as float64 0-d tensors on the policy's device until the step ends:
    a float() per micro-batch would make the host wait for the GPU to finish that micro-batch before it may
    queue the next one. float64, so that the sums equal Python float sums of the fp32 terms (each converted
    to double, divided and summed). ``result`` brings them all to the host in one transfer.

    A step runs ``num_iterations`` passes over its batch of ``mini_batches`` updates each (update ``u`` is
    mini-batch ``u % mini_batches`` of pass ``u // mini_batches``). ``totals``: the step's, means over its
    updates (loss, the token means kl, clip_fraction and ratio_mean, loss/ptx); the entropy and ``sampler_is/*``
    token means over the step's sampled tokens in the first pass; ``mismatch/*`` the first update's, the one
    whose every row is still at the weights that started the step. ``updates``: each update's own (its
    mini-batch's means), by ``UpdateStats``' field names, the row min/max starting at +-inf (no row yet).
    ``sampled_tokens``: 0-d, the step's sampled tokens on this rank (at least 1), the first pass's denominator;
    None: each micro-batch's ``LossInputs.sampled_tokens``, which are the step's when it has one mini-batch.
    """

    def __init__(self, num_iterations: int, device: torch.device, sampler_is: bool, ptx: bool, mismatch: bool = False,
                 *, mini_batches: int = 1, sampled_tokens: torch.Tensor | None = None):
        def zero() -> torch.Tensor:
            return torch.zeros((), dtype=torch.float64, device=device)

        def bound(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=torch.float64, device=device)

        names = ("loss", *TOKEN_MEANS, "entropy", *(("loss/ptx",) if ptx else ()),
                 *(SAMPLER_IS if sampler_is else ()), *(MISMATCH if mismatch else ()))
        self.num_updates, self.mini_batches = num_iterations * mini_batches, mini_batches
        self.sampled_tokens = sampled_tokens
        self.totals = {name: zero() for name in names}
        self.updates = [{**{name: zero() for name in ("loss", "policy_loss", "clip_fraction", "vespo_phi_mean", "kl",
                                                      "entropy", "ratio_mean", *CLIP_COUNTS)},
                         "clip_low_row_min": bound(float("inf")), "clip_high_row_max": bound(float("-inf"))}
                        for _ in range(self.num_updates)]
        self.entropy_coefs: list[float | None] = []
        self.grad_norms: list[float | None] = []
        self.learning_rates: list[float] = []
        self.seconds: list[float] = []
        self.routing: list[Replaying] = []  # routing replay's counts, one per update pass
        self.overflows = 0  # updates fp16's loss scaler skipped (UpdateOutcome.overflow)
        self.loss_scale: float | None = None  # fp16: the scale after the step's last update

    @torch.no_grad()
    def add_micro_batch(self, part: MicroBatchLoss, inputs: LossInputs, update: int) -> None:
        """Add one micro-batch of update ``update`` (``inputs``: its mini-batch's)."""
        totals, own, n = self.totals, self.updates[update], self.num_updates
        first_pass = update < self.mini_batches
        step_sampled = inputs.sampled_tokens if self.sampled_tokens is None else self.sampled_tokens
        # kl, clip_fraction and ratio_mean are token means within the micro-batch: weighted by its share of the
        # update's tokens they are the update's token means, however the rows were split
        token_share = (part.mask.sum() / inputs.total_tokens.clamp(min=1)).double()
        loss = part.objective.detach().double()  # the weighted loss less the entropy bonus: what backward ran on
        means = {key: part.stats[key].double() * token_share for key in TOKEN_MEANS}
        totals["loss"] += loss / n
        for key, value in means.items():
            totals[key] += value / n
        entropy_sum = (part.entropy * part.sampled).sum()
        entropy = (entropy_sum / inputs.sampled_tokens).double()
        if first_pass:  # token mean over every sampled token of the step
            totals["entropy"] += entropy if self.sampled_tokens is None else (entropy_sum / step_sampled).double()
        rows_share = part.mask.shape[0] / inputs.generation.completion_ids.shape[0]
        for key, value in (("loss", loss), ("policy_loss", (part.loss.detach() * part.weight).double()),
                           ("clip_fraction", means["clip_fraction"]), ("kl", means["kl"]), ("entropy", entropy),
                           ("ratio_mean", means["ratio_mean"]),
                           ("vespo_phi_mean", part.stats.get("vespo_phi_mean", part.loss.new_zeros(())).double() * rows_share)):
            own[key] += value
        for key in CLIP_COUNTS:
            own[key] += part.stats[key].double()
        own["clip_low_row_min"] = torch.minimum(own["clip_low_row_min"], part.stats["clip_low_row_min"].double())
        own["clip_high_row_max"] = torch.maximum(own["clip_high_row_max"], part.stats["clip_high_row_max"].double())
        if part.router_aux is not None:  # the micro-batches' row-weighted mean, over the updates
            aux = totals.setdefault("moe/aux_loss", torch.zeros((), dtype=torch.float64, device=part.router_aux.device))
            totals["moe/aux_loss"] = aux + part.router_aux.detach().double() * rows_share / n
        if part.is_weights is not None and first_pass:
            gap = (part.old - part.sampler).abs().masked_fill(part.sampled == 0, 0.0)  # padding may hold -inf
            for key, summed in zip(SAMPLER_IS, ((part.is_weights * part.sampled).sum(),
                                                (part.outside * part.sampled).sum(), gap.sum())):
                totals[key] += (summed / step_sampled).double()
        if part.reported is not None and update == 0:  # the weights that start the step vs the sampler's
            sums = mismatch_sums(part.current, part.reported, part.sampled, part.is_weights)
            totals["mismatch/k3"] += sums.k3 / inputs.sampled_tokens.double()
            totals["mismatch/masked_fraction"] += sums.masked / inputs.sampled_tokens.double()
            totals["mismatch/ratio_max"] = torch.maximum(totals["mismatch/ratio_max"], sums.ratio_max)

    def add_ptx(self, nll: torch.Tensor) -> None:
        self.totals["loss/ptx"] += nll.detach().double() / self.num_updates

    def end_update(self, outcome: UpdateOutcome, learning_rate: float, seconds: float,
                   entropy_coef: float | None = None) -> None:
        """The update's host values: what the learner did (its gradient norm, None: skipped; fp16's loss scale),
        its rate, wall time and entropy coefficient (None: no bonus)."""
        self.entropy_coefs.append(entropy_coef)
        self.grad_norms.append(outcome.grad_norm)
        self.learning_rates.append(learning_rate)
        self.seconds.append(seconds)
        self.overflows += outcome.overflow
        if outcome.loss_scale is not None:
            self.loss_scale = outcome.loss_scale

    def add_routing(self, replaying: Replaying) -> None:
        """An update pass's routing replay: its routings the pass would have chosen otherwise, over its recorded."""
        self.routing.append(replaying)

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
        routed = sum(r.routed for r in self.routing)
        if routed:  # the update passes' share of recorded (token, layer) routings they would have chosen otherwise
            totals["moe/routing_mismatch"] = sum(r.mismatch for r in self.routing) / routed
        if self.loss_scale is not None:  # fp16: the overflow skips among them (not counted by SkipGuard)
            totals.update({"fp16/loss_scale": self.loss_scale, "fp16/overflow_updates": float(self.overflows)})
        if self.entropy_coefs and self.entropy_coefs[-1] is not None:  # the bonus's: the loss without it, the coef
            totals["policy_loss"] = sum(row["policy_loss"] for row in rows) / len(rows)
            totals["entropy_coef"] = self.entropy_coefs[-1]
        return StepUpdate(totals, [UpdateStats(**row, grad_norm=norm, learning_rate=rate, seconds=seconds,
                                               entropy_coef=coef)
                                   for row, norm, rate, seconds, coef in zip(rows, self.grad_norms, self.learning_rates,
                                                                             self.seconds, self.entropy_coefs)])
