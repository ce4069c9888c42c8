"""The ``eval`` section of the config tree (``grpo.config.schema``): how a run evaluates its held-out sets
(``data.eval``) at start, every ``train.eval_steps`` and at the end. ``num_samples``' peer is verl's
``val_kwargs`` (n, temperature, do_sample); TRL's ``num_generations_eval`` is the loss pass's ``num_generations``."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.fields import opt


@dataclass
class EvalConfig:
    num_samples: int = opt(
        1, "k: completions sampled per held-out problem at eval.temperature, beside the greedy one (mean@k, "
        "unbiased pass@1/2/4..k, maj@k); 1 = greedy only.", ge=1)
    temperature: float = opt(1.0, "Sampling temperature of the k samples (eval.num_samples > 1).", gt=0)
    bootstrap: int = opt(
        0, "Bootstrap resamples of the problems for 95% intervals of accuracy, pass@j and maj@k "
        "(<metric>_ci_low/_ci_high); 0 = none.", ge=0)
    batch_size: int | None = opt(
        None, "Completions per generation call in evaluation (the sets share calls); null = what a training step "
        "generates at once on a rank (rollout.generation_batch_size, else prompts_per_step x num_generations / ranks), "
        "at least 16.", ge=1)
    save_records: bool = opt(
        True, "Write each evaluation's per-example records (prediction, correct, rewards, completions) to "
        "<output_dir>/eval/step_<N>/<set>.jsonl.")
    max_samples_written: int = opt(
        2, "Sampled completions written per example in those records (the greedy one is always written).", ge=0)
    loss_pass: bool = opt(
        False, "Also sample rollout.num_generations completions per held-out prompt, score them with the run's "
        "rewards and log the training loss on them without gradients, the current weights as the old policy "
        "(eval/loss, eval/entropy, eval/clip_ratio/*, eval/frac_reward_zero_std, eval/kl with loss.beta): TRL's "
        "eval_loss. The Python API turns it on; it costs a sampled generation beside the greedy one.")
    num_generations: int | None = opt(
        None, "Completions sampled per held-out prompt by eval.loss_pass (its groups, advantages, rewards and "
        "loss; TRL's num_generations_eval, fewer to save compute); null = rollout.num_generations.", ge=1)
    loss_batch_size: int = opt(
        8, "Completions per batch of eval.loss_pass (TRL's per_device_eval_batch_size: that many // "
        "num_generations prompts); the loss is normalised per batch, as a training micro-batch's.", ge=1)
