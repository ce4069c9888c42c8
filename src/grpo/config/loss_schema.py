"""The ``loss`` section of the config tree (``grpo.config.schema``): the policy loss, its clip, KL, masks and
entropy bonus (TRL 1.16's loss fields, by their grpo names: ``grpo.api.trl_fields``)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.algorithm import ADVANTAGE_SCALES, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SAMPLER_CORRECTIONS
from grpo.config.fields import opt


@dataclass
class LossConfig:
    beta: float = opt(0.04, "KL coefficient (k3 estimator against the reference); 0 = no reference model.", ge=0)
    kl_times_ratio: bool = opt(False, "The KL term is ratio x k3 (the tokens come from the old policy): TRL's "
                                      "use_bias_correction_kl (its default); false: plain k3.")
    ref_sync_steps: int | None = opt(
        None, "TR-DPO's moving reference (TRL's sync_ref_model): every N steps, after the step's update, the "
        "reference becomes loss.ref_mixup_alpha x policy + (1 - alpha) x reference, parameter by parameter (kept in "
        "checkpoints); null = a fixed reference. Under LoRA the reference is then a copy of the base (a second "
        "model in memory, not the adapter switched off) mixed toward the policy's merged weights (base + the "
        "adapter's delta). Colocated with loss.beta > 0 only: not with a teacher (model.ref_name_or_path), a 4-bit "
        "base, train.mode decoupled (the samplers' reference sees only the weights they load), deepspeed or fsdp.",
        ge=1)
    ref_mixup_alpha: float = opt(
        0.6, "loss.ref_sync_steps: the policy's share in the moved reference (TRL's ref_model_mixup_alpha; 1: the "
        "reference becomes the policy).", ge=0, le=1)
    epsilon: float = opt(0.2, "Lower clip: ratio >= 1 - epsilon.", gt=0, le=1)
    epsilon_high: float | None = opt(None, "Upper clip: ratio <= 1 + epsilon_high (DAPO); null = epsilon. With loss_type "
                                           "cispo: the cap on the ratio itself (not 1 + it).", gt=0)
    delta: float | None = opt(
        None, "Two-sided clipping (INTELLECT-2, TRL's delta): the unclipped branch's ratio is capped at delta, so a "
        "token with a negative advantage whose ratio ran far above 1 stops pushing at delta x A; above 1 + "
        "epsilon_high; null = off. The clipped surrogate's loss types only.", gt=1)
    loss_type: str = opt(
        "grpo", "TRL's loss types: the clipped surrogate aggregated as grpo (per-sequence mean), bnpo (token mean of "
        "the micro-batch), dr_grpo (sum / (rows x max_completion_length)), dapo (sum / the step's tokens) or luspo "
        "(each sequence's mean times its length, a per-row mean); or an objective of its own: cispo (MiniMax-M1: "
        "sg(min(ratio, epsilon_high)) x A x log pi, epsilon_high an absolute cap, e.g. 5.0), sapo (a smooth "
        "sigmoid gate, sapo_temperature_*, aggregated as grpo), vespo (a Gamma weight of the sequence's ratio, "
        "vespo_*); cispo and vespo normalised as dapo.", choices=tuple(LOSS_TYPES))
    scale_rewards: str | None = opt(
        None, "grpo estimator's scaling: group std, batch std (of the raw rewards), or none (Dr. GRPO); null = "
        "group. rloo and reinforce_pp scale by their definition and need null.",
        choices=(None, *ADVANTAGE_SCALES))
    importance_sampling_level: str = opt(
        "token", "token: one ratio per token (GRPO/PPO); sequence: GSPO, one ratio per completion (exp of the mean "
        "token log-ratio), usually with tiny clips (GSPO: epsilon 3e-4, epsilon_high 4e-4). The two differ only "
        "once the policy has moved since sampling (num_iterations > 1, or a stale decoupled rollout).",
        choices=tuple(IMPORTANCE_SAMPLING_LEVELS))
    mask_truncated_completions: bool = opt(
        False, "DAPO: completions that hit max_completion_length without EOS contribute no loss (they still "
               "count in their group's advantages).")
    num_iterations: int = opt(1, "Optimisation passes per rollout batch (mu), each of train.mini_batches updates; "
                                 "more than one update per step computes old log-probs.", ge=1)
    sampler_is_correction: bool = opt(
        False, "Truncated importance-sampling correction for a sampler that is not the trainer (rollout.engine vllm, "
               "or train.mode decoupled): each token's surrogate is weighted by pi_old / pi_sampler (the trainer's "
               "log-prob at the weights that start the update over the sampler's own), bounded by sampler_is_cap; "
               "the KL term is not weighted. TRL's vllm_importance_sampling_correction.")
    sampler_is_mode: str = opt(
        "token_truncate", "sampler_is_correction: token_truncate (min(ratio, cap) per token), token_mask (0 where "
        "the ratio is above the cap), sequence_truncate / sequence_mask (one ratio per completion, the product of "
        "its tokens'). TRL's vllm_importance_sampling_mode.",
        choices=tuple(SAMPLER_CORRECTIONS))
    sampler_is_cap: float = opt(
        3.0, "sampler_is_correction: the cap C on the weights (TRL's vllm_importance_sampling_clip_max).", gt=0)
    sampler_is_min: float | None = opt(
        None, "sampler_is_correction: a lower bound below sampler_is_cap (TRL's vllm_importance_sampling_clip_min): "
              "the truncate modes raise smaller ratios to it, the mask modes zero them; null: none.", ge=0)
    advantage_eps: float = opt(1e-4, "Added to the std when scaling advantages.", gt=0)
    value_clip: float = opt(
        0.2, "gae: the critic's new value may move this far from its sampling-time value before PPO's clipped "
        "value loss takes over (in reward units).", gt=0)
    sapo_temperature_pos: float = opt(1.0, "loss_type sapo: the gate's temperature for tokens with A > 0.", gt=0)
    sapo_temperature_neg: float = opt(1.05, "loss_type sapo: the gate's temperature for tokens with A <= 0.", gt=0)
    vespo_k_pos: float = opt(2.0, "loss_type vespo: the Gamma weight's power k where A >= 0.", ge=0)
    vespo_lambda_pos: float = opt(3.0, "loss_type vespo: the Gamma weight's rate lambda where A >= 0.", gt=0)
    vespo_k_neg: float = opt(3.0, "loss_type vespo: k where A < 0.", ge=0)
    vespo_lambda_neg: float = opt(2.0, "loss_type vespo: lambda where A < 0.", gt=0)
    top_entropy_quantile: float = opt(
        1.0, "Beyond the 80/20 rule: only the tokens whose entropy is in this top share of a micro-batch's loss "
        "tokens keep their policy loss (0.2: the top 20%); the KL term and the token counts keep every token. 1 = "
        "all. TRL's, per micro-batch; several ranks are not pooled (each rank's micro-batch).", ge=0, le=1)
    off_policy_mask_threshold: float | None = opt(
        None, "DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage loses its policy "
        "loss when the mean over its tokens of log pi_sampler - log pi exceeds this (the sampler's own log-probs "
        "where another engine sampled, else the old ones); null = off.", ge=0)
    entropy_coef: float = opt(
        0.0, "Entropy bonus: the loss minus entropy_coef x the mean entropy of the loss tokens (those the "
        "top_entropy_quantile mask keeps), its gradient through the tempered distribution; each micro-batch's "
        "bonus weighted by its share of the update, as TRL. With adaptive_entropy: the starting coefficient.",
        ge=0)
    adaptive_entropy: bool = opt(
        False, "Skywork-OR1's adaptive coefficient (TRL's use_adaptive_entropy): the bonus applies only once the "
        "measured entropy is at or below entropy_target, and after every optimizer update the coefficient moves "
        "by entropy_coef_delta (up when the update's entropy is at or below the target, down otherwise) within "
        "[entropy_coef_min, entropy_coef_max]; checkpointed.")
    entropy_target: float = opt(0.2, "adaptive_entropy: the target mean entropy (nats).", ge=0)
    entropy_coef_delta: float = opt(0.005, "adaptive_entropy: the coefficient's step per optimizer update.", ge=0)
    entropy_coef_min: float = opt(0.0, "adaptive_entropy: the coefficient's lower bound.", ge=0)
    entropy_coef_max: float = opt(1.0, "adaptive_entropy: the coefficient's upper bound.", ge=0)
    router_aux_loss_coef: float | None = opt(
        None, "Mixture-of-Experts policies: the router's load-balancing loss (Switch Transformer's, over every real "
        "token of each micro-batch, prompt and completion) is added to the loss times this, each micro-batch's "
        "weighted by its share of the update's rows (TRL's 1 / gradient_accumulation_steps); logged as "
        "moe/aux_loss. null: the model config's router_aux_loss_coef (Mixtral, Qwen3-MoE, GPT-OSS, ERNIE-4.5-MoE: "
        "0.001 as shipped; a dense model: none); 0: off. A non-zero value for a model without router logits "
        "(dense, DeepSeek-V3, GLM-4-MoE) is refused. TRL's router_aux_loss_coef.", ge=0)
    routing_replay: bool = opt(
        False, "Mixture-of-Experts policies: routing replay (R3). The rollout records the experts every router chose "
        "for each token, and the update's passes (old and new log-probs) route each token to them, each router's "
        "weights recomputed from the pass's own logits (so the router still learns): the ratio no longer moves "
        "because the update picked other experts than the sampler. Logs moe/routing_mismatch, the share of "
        "(token, layer) routings the update would have chosen otherwise. The hf engine, single-turn, colocated "
        "or decoupled (the wire and partial rollouts carry the routing): the other engines and tools do not "
        "record the routing yet and are refused.")
