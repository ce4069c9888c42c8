"""The held-out loss pass (``eval.loss_pass``): TRL's ``eval_loss``, ``eval_entropy``, ``eval_clip_ratio/*``,
``eval_frac_reward_zero_std`` and ``eval_kl``.

TRL's evaluation runs its training loss on every eval batch without gradients (``prediction_step``): a batch of
``per_device_eval_batch_size`` completions (``// num_generations`` prompts, each sampled ``num_generations``
times), scored by the rewards, advantages per group, the current weights their own old policy (the ratio is 1).
Here a batch is sampled and scored as a training step's (``grpo.step.experience``) and its loss is the update's
own micro-batch loss (``grpo.step.policy_update``), so the two cannot differ. Batches are averaged as TRL's are:
the loss weighted by the batch's rows (Trainer's evaluation loop), the other metrics plain means (TRL's ``log``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from grpo.data import Example
from grpo.data.prompt_sampler import step_seed
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import UpdateOutcome
from grpo.step.dynamic_sampling import zero_spread_groups
from grpo.step.experience import ExperienceSettings, RefLogprobs, finish_experience, sample_and_score
from grpo.step.metrics import reduce_updates
from grpo.step.micro_batch_loss import micro_batch_loss
from grpo.step.update_inputs import LossSettings, prepare_batch
from grpo.step.update_stats import StepStats
from grpo.step.records import RolloutBatch

ROWS = "rows"  # a batch's completions: the loss's weight in the mean over batches
CLIP_RATIOS = ("clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
               "clip_ratio/region_mean")


@dataclass(frozen=True)
class EvalLossSettings:
    """The loss pass's sampling (``rollout.*``, ``num_generations`` per prompt), its loss (``loss.*``, one
    iteration, no old log-probs: the pass's own), its batch (``eval.loss_batch_size`` completions) and seed."""

    experience: ExperienceSettings
    loss: LossSettings
    batch_size: int
    seed: int

    @property
    def prompts_per_batch(self) -> int:
        return max(1, self.batch_size // self.experience.sampling.n)


@torch.no_grad()
def batch_loss_metrics(policy: torch.nn.Module, batch: RolloutBatch, s: LossSettings) -> dict[str, float]:
    """The loss of one finished ``batch`` under ``policy`` without gradients, as one update's micro-batches
    compute it (its old log-probs: the pass's own), with its statistics under TRL's names (``loss``, ``entropy``,
    ``clip_ratio/*``, ``kl`` when ``s.beta``), ``frac_reward_zero_std`` and its ``rows``."""
    device = next(policy.parameters()).device
    inputs = prepare_batch(batch, s, DistInfo(), device)  # one process's batch, normalised alone (TRL's eval)
    stats = StepStats(1, device, inputs.sampler_logprobs is not None, ptx=False)
    for rows, on_device in inputs.micro_batches:
        stats.add_micro_batch(micro_batch_loss(policy, inputs, rows, on_device, None, s), inputs, 0)
    stats.end_update(UpdateOutcome(None), 0.0, 0.0)  # no optimizer step: no norm
    update = reduce_updates([[asdict(stats.result(0.0).updates[0])]])[0]
    group_size = batch.rewards.shape[0] // max(len(batch.prompts), 1)
    metrics = {name: update[name] for name in ("loss", "entropy", *CLIP_RATIOS)}
    if s.beta:
        metrics["kl"] = update["kl"]
    metrics["frac_reward_zero_std"] = zero_spread_groups(batch.rewards, group_size).float().mean().item()
    metrics[ROWS] = float(batch.rewards.shape[0])
    return metrics


@dataclass
class LossPass:
    """The loss pass of a run's evaluation (``grpo.training.evaluator.RunEvaluator.loss_pass``): its batches
    sampled by ``engine`` (the evaluation's), scored by the run's rewards, the reference's log-probs from
    ``ref_logprobs`` (None: no ``kl``)."""

    settings: EvalLossSettings
    engine: object
    policy: torch.nn.Module
    tokenizer: object
    reward_fns: Sequence
    reward_weights: Sequence[float]
    ref_logprobs: RefLogprobs | None = None

    def __call__(self, examples: Sequence[Example], step: int, first_example: int = 0) -> list[dict[str, float]]:
        """``batch_loss_metrics`` of each batch of ``examples`` (``prompts_per_batch`` prompts each) at ``step``,
        in eval mode (no dropout, as TRL's evaluation), the caller's RNG streams untouched. A batch's seed is a
        function of (run seed, ``step``, its first example's index in its whole set; ``first_example``:
        ``examples[0]``'s), so that a rank's slice samples what one process would."""
        s, policy = self.settings, self.policy
        devices = sorted({p.device.index or 0 for p in policy.parameters() if p.device.type == "cuda"})
        was_training, out = policy.training, []
        policy.eval()
        try:
            with torch.random.fork_rng(devices=devices):
                for start in range(0, len(examples), s.prompts_per_batch):
                    # step_seed's rank slot holds the example index and round 1 keeps it off the training seeds
                    seed = step_seed(s.seed, step, first_example + start, round_index=1)
                    scored = sample_and_score(self.engine, self.tokenizer, examples[start:start + s.prompts_per_batch],
                                              self.reward_fns, self.reward_weights, s.experience, seed=seed,
                                              steps_done=step)
                    batch = finish_experience(scored, policy, self.ref_logprobs, s.experience)
                    out.append(batch_loss_metrics(policy, batch, s.loss))
        finally:
            policy.train(was_training)
        return out


def mean_of_batches(batches: Sequence[dict[str, float]]) -> dict[str, float]:
    """TRL's means over eval batches: ``loss`` weighted by each batch's ``rows``; the others plain means of
    their non-NaN values (NaN where none is)."""
    if not batches:
        return {}
    rows = sum(b[ROWS] for b in batches)
    out = {"loss": sum(b["loss"] * b[ROWS] for b in batches) / rows}
    for name in dict.fromkeys(k for b in batches for k in b if k not in ("loss", ROWS)):
        values = [b[name] for b in batches if name in b and not math.isnan(b[name])]
        out[name] = sum(values) / len(values) if values else math.nan
    return out
