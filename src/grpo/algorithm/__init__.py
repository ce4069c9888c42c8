"""The RL math: pure functions of tensors, no config objects, ranks or logging.

Layout convention: completions of one prompt are contiguous, rows ``i*G .. i*G+G-1`` belong to
prompt ``i``; ``N = P*G``. ``L`` is the completion length (padded), ``T`` a full sequence length,
``V`` the vocabulary size.

- ``advantages``: outcome estimators per group (grpo, rloo, reinforce_pp), GAE, whitening, per-token
  rewards with the KL penalty in them.
- ``tokens``: log-probs of the sampled tokens and the entropy of their distributions, from logits.
- ``processing``: the sampling controls (repetition penalty, min_new_tokens, min_p) as Hugging Face
  applies them, per position for the samplers and over every completion position for the log-probs.
- ``losses``: the clipped policy surrogate (token or sequence importance ratios), its aggregation,
  PPO's clipped value loss, the PTX next-token loss (``sft_loss``).
- ``sampler_correction``: the importance weights for tokens another engine sampled, the sampler/trainer
  log-prob gap.
- ``mismatch``: the sampler/trainer mismatch a step logs (k3, largest ratio, masked tokens) and the staleness
  of each token's policy version.

Variants are looked up by name in ``ADVANTAGE_ESTIMATORS``, ``ADVANTAGE_SCALES``,
``IMPORTANCE_SAMPLING_LEVELS``, ``LOSS_AGGREGATIONS``, ``SAMPLER_CORRECTIONS`` and ``schedules.LR_SCHEDULES``
(the learning rate's decay); an unknown name raises a ``ValueError`` listing the known ones. The config's
choices are these registries' names.
"""

from grpo.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    AdvantageEstimator,
    advantage_estimator,
    gae_advantages,
    group_advantages,
    kl_penalized_token_rewards,
    whiten,
)
from grpo.algorithm.losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    kl_k3,
    loss_aggregation,
    policy_loss,
    sft_loss,
    value_loss,
)
from grpo.algorithm.mismatch import MismatchSums, mismatch_sums, oldest_version, token_staleness
from grpo.algorithm.processing import LogprobProcessing, processed_token_entropy, processed_token_logprobs
from grpo.algorithm.sampler_correction import (
    SAMPLER_CORRECTIONS,
    logprob_mismatch,
    sampler_importance_weights,
    truncated_importance_weights,
)
from grpo.algorithm.tokens import token_entropy, token_logprobs

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ADVANTAGE_SCALES", "IMPORTANCE_SAMPLING_LEVELS", "LOSS_AGGREGATIONS", "LogprobProcessing",
    "SAMPLER_CORRECTIONS", "AdvantageEstimator", "LossAggregation", "MismatchSums", "mismatch_sums",
    "oldest_version", "token_staleness", "advantage_estimator", "loss_aggregation",
    "aggregate_loss", "gae_advantages", "group_advantages", "kl_k3", "kl_penalized_token_rewards", "logprob_mismatch",
    "policy_loss", "processed_token_entropy", "processed_token_logprobs", "sampler_importance_weights", "sft_loss",
    "token_entropy", "token_logprobs", "truncated_importance_weights", "value_loss", "whiten",
]
