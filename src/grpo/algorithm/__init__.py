"""The RL math: pure functions of tensors, no config objects, ranks or logging.

Layout convention: completions of one prompt are contiguous, rows ``i*G .. i*G+G-1`` belong to
prompt ``i``; ``N = P*G``. ``L`` is the completion length (padded), ``T`` a full sequence length,
``V`` the vocabulary size.

- ``advantages``: outcome estimators per group (grpo, rloo, reinforce_pp), GAE, whitening, per-token
  rewards with the KL penalty in them, several reward functions' scores combined (``multi_reward_advantages``).
- ``tokens``: log-probs of the sampled tokens and the entropy of their distributions, from logits.
- ``processing``: the sampling controls (repetition penalty, min_new_tokens, min_p) as Hugging Face
  applies them, per position for the samplers and over every completion position for the log-probs.
- ``losses``: the policy loss of every loss type (token or sequence importance ratios) with its KL penalty,
  PPO's clipped value loss, the PTX next-token loss (``sft_loss``).
- ``objectives``: the per-token objectives of TRL's loss types (PPO's clip with ``delta``, CISPO, SAPO, VESPO);
  ``aggregation``: how a per-token loss becomes a scalar, and each loss type's (objective, aggregation).
- ``token_masks``: which tokens keep their policy loss (high entropy, off-policy sequences); ``entropy``: the
  entropy bonus and its adaptive coefficient.
- ``sampler_correction``: the importance weights for tokens another engine sampled, the sampler/trainer
  log-prob gap.
- ``load_balancing``: the Mixture-of-Experts router's load-balancing loss (``loss.router_aux_loss_coef``).
- ``mismatch``: the sampler/trainer mismatch a step logs (k3, largest ratio, masked tokens) and the staleness
  of each token's policy version.

Variants are looked up by name in ``ADVANTAGE_ESTIMATORS``, ``ADVANTAGE_SCALES``, ``MULTI_OBJECTIVE_AGGREGATIONS``,
``IMPORTANCE_SAMPLING_LEVELS``, ``LOSS_AGGREGATIONS``, ``LOSS_TYPES`` (TRL's loss types: an objective in
``POLICY_OBJECTIVES`` and an aggregation), ``SAMPLER_CORRECTIONS`` and ``schedules.LR_SCHEDULES`` (the learning
rate's decay); an unknown name raises a ``ValueError`` listing the known ones. The config's choices are these
registries' names (``loss.loss_type``: ``LOSS_AGGREGATIONS``', the clipped surrogate's loss types).
"""

from grpo.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    AdvantageEstimator,
    advantage_estimator,
    gae_advantages,
    group_advantages,
    kl_penalized_token_rewards,
    multi_reward_advantages,
    whiten,
)
from grpo.algorithm.aggregation import LOSS_TYPES, LossType, loss_type_entry
from grpo.algorithm.entropy import (
    AdaptiveEntropyState,
    adaptive_entropy_step,
    applied_entropy_coef,
    entropy_bonus,
    entropy_sums,
)
from grpo.algorithm.load_balancing import load_balancing_loss
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
from grpo.algorithm.objectives import (
    POLICY_OBJECTIVES,
    cispo_objective,
    clipped_objective,
    sapo_objective,
    vespo_objective,
    vespo_weights,
)
from grpo.algorithm.processing import LogprobProcessing, processed_token_entropy, processed_token_logprobs
from grpo.algorithm.sampler_correction import (
    SAMPLER_CORRECTIONS,
    logprob_mismatch,
    sampler_importance_weights,
    truncated_importance_weights,
)
from grpo.algorithm.token_masks import high_entropy_mask, off_policy_mask
from grpo.algorithm.tokens import token_entropy, token_entropy_with_grad, token_logprobs

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ADVANTAGE_SCALES", "IMPORTANCE_SAMPLING_LEVELS", "LOSS_AGGREGATIONS", "LogprobProcessing",
    "SAMPLER_CORRECTIONS", "AdvantageEstimator", "LossAggregation", "MismatchSums", "mismatch_sums",
    "oldest_version", "token_staleness", "advantage_estimator", "loss_aggregation",
    "aggregate_loss", "gae_advantages", "group_advantages", "kl_k3", "kl_penalized_token_rewards", "logprob_mismatch",
    "policy_loss", "processed_token_entropy", "processed_token_logprobs", "sampler_importance_weights", "sft_loss",
    "token_entropy", "token_entropy_with_grad", "token_logprobs", "truncated_importance_weights", "value_loss", "whiten",
    # TRL 1.16's loss types, token masks, entropy bonus and multi-reward advantages
    "LOSS_TYPES", "LossType", "loss_type_entry", "MULTI_OBJECTIVE_AGGREGATIONS", "multi_reward_advantages",
    "POLICY_OBJECTIVES", "clipped_objective", "cispo_objective", "sapo_objective", "vespo_objective", "vespo_weights",
    "high_entropy_mask", "off_policy_mask", "AdaptiveEntropyState", "adaptive_entropy_step", "applied_entropy_coef",
    "entropy_bonus", "entropy_sums",
    # the MoE router's load-balancing loss (TRL's router_aux_loss_coef)
    "load_balancing_loss",
]
