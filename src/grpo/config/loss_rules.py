"""The rules of the ``loss`` section against the rest of the config: the reference and the clip range, TRL's loss
types (cispo, sapo, vespo; delta), the masks and the entropy bonus, and TR-DPO's moving reference. Each returns
``(key, why)`` pairs, as ``grpo.config.rules``' checks do (that module lists them in its ``RULES``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.algorithm import advantage_estimator

if TYPE_CHECKING:
    from grpo.config.schema import RunConfig


def loss_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The reference, the clip range and the reward scaling against the loss and the estimator."""
    problems = []
    if cfg.model.ref_name_or_path is not None and cfg.loss.beta == 0:
        problems.append(("model.ref_name_or_path", (
            "is set but loss.beta is 0: the reference only serves the KL term and would be loaded for "
            "nothing; set loss.beta > 0 or model.ref_name_or_path: null")))
    if cfg.loss.epsilon_high is not None and cfg.loss.epsilon_high < cfg.loss.epsilon:
        problems.append(("loss.epsilon_high", (
            f"{cfg.loss.epsilon_high} < loss.epsilon {cfg.loss.epsilon}: the asymmetric clip (DAPO) only "
            "raises the upper bound")))
    problems += ref_sync_problems(cfg)
    if cfg.loss.scale_rewards is not None and not advantage_estimator(cfg.algorithm.advantage_estimator).takes_scale:
        problems.append(("loss.scale_rewards", (
            f"is {cfg.loss.scale_rewards!r} but algorithm.advantage_estimator is "
            f"{cfg.algorithm.advantage_estimator!r}, whose scaling is part of its definition (rloo: none; "
            "reinforce_pp: the batch std of the centred rewards; gae: whitening of the token advantages); "
            "set loss.scale_rewards: null")))
    return problems


CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss types of the clipped surrogate (delta caps it)


def loss_type_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The loss types' own keys (TRL's cispo, sapo, vespo; delta; the masks and the entropy bonus) against the rest."""
    loss, problems = cfg.loss, []
    eps_high = loss.epsilon if loss.epsilon_high is None else loss.epsilon_high
    if loss.delta is not None and loss.loss_type not in CLIPPED:
        problems.append(("loss.delta", f"is set but loss.loss_type {loss.loss_type} has no clipped branch to cap "
                                       f"(delta caps the clipped surrogate's: {', '.join(CLIPPED)}); set delta: null"))
    elif loss.delta is not None and loss.delta <= 1 + eps_high:
        problems.append(("loss.delta", f"{loss.delta} is not above 1 + epsilon_high = {1 + eps_high}: it would cap "
                                       "the ratio of positive advantages too, below the clip range; INTELLECT-2 "
                                       "sets it above (e.g. 4)"))
    if loss.loss_type == "cispo" and loss.epsilon_high is None:
        problems.append(("loss.loss_type", (
            f"is cispo with loss.epsilon_high null: its cap on the ratio itself would be epsilon ({loss.epsilon}), so "
            "every token's weight would be at most that; set loss.epsilon_high to the cap (MiniMax-M1/ScaleRL: 5.0)")))
    if loss.loss_type == "vespo" and loss.sampler_is_correction and loss.sampler_is_mode.startswith("sequence"):
        problems.append(("loss.sampler_is_mode", (
            f"is {loss.sampler_is_mode} with loss.loss_type vespo, which folds each token's weight into its own "
            "sequence weight: use token_truncate or token_mask (TRL refuses this too)")))
    controls = cfg.rollout.repetition_penalty != 1.0 or cfg.rollout.min_new_tokens > 0 or cfg.rollout.min_p > 0.0
    if (loss.entropy_coef > 0 or loss.adaptive_entropy) and controls:
        problems.append(("loss.entropy_coef", (
            "cannot be combined with rollout.repetition_penalty / min_new_tokens / min_p yet: the bonus's gradient "
            "is through the plain tempered distribution, while the log-probs follow the processed one")))
    if loss.entropy_coef_min > loss.entropy_coef_max:
        problems.append(("loss.entropy_coef_min", f"{loss.entropy_coef_min} > loss.entropy_coef_max "
                                                  f"{loss.entropy_coef_max}"))
    if cfg.algorithm.multi_objective_aggregation == "normalize_then_sum":
        if cfg.algorithm.advantage_estimator != "grpo":
            problems.append(("algorithm.multi_objective_aggregation", (
                f"normalize_then_sum is the grpo estimator's (GDPO); algorithm.advantage_estimator is "
                f"{cfg.algorithm.advantage_estimator}: use sum_then_normalize")))
        elif loss.scale_rewards is not None:
            problems.append(("loss.scale_rewards", (
                f"is {loss.scale_rewards!r} with algorithm.multi_objective_aggregation normalize_then_sum, which "
                "normalises each reward in its group and the sum over the batch itself; set loss.scale_rewards: null")))
    return problems


def ref_sync_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """TR-DPO's moving reference needs a reference of the policy's own parameters that this process holds."""
    loss, sync = cfg.loss, "loss.ref_sync_steps"
    if loss.ref_sync_steps is None:
        moved = loss.ref_mixup_alpha != type(loss)().ref_mixup_alpha
        return [("loss.ref_mixup_alpha", "is set but loss.ref_sync_steps is null: the reference never moves")
                ] if moved else []
    why = [  # (refused, reason), the first that holds is reported
        (loss.beta == 0, "loss.beta is 0: there is no reference to move (TRL refuses sync_ref_model with beta 0)"),
        (cfg.model.load_in_4bit, "model.load_in_4bit is set: the moving reference is a copy of the base mixed "
                                 "toward the policy's effective weights, which a 4-bit base cannot hold; use a "
                                 "bf16 base"),
        (cfg.model.ref_name_or_path is not None, "model.ref_name_or_path names a teacher: TR-DPO moves a copy of the "
                                                 "policy toward it, which another model's parameters cannot follow"),
        (cfg.train.mode == "decoupled", "train.mode is decoupled: the samplers (or decoupled.ref_server) hold the "
                                        "reference and see only the published weights they load, not the policy "
                                        "of every sync step; train colocated"),
        (bool(cfg.train.deepspeed), "train.deepspeed is set: under ZeRO-3 each rank holds a shard of the policy, "
                                    "and the sync reads whole parameters (not implemented)"),
        (cfg.train.fsdp, "train.fsdp is set: each rank holds a shard of the policy and of the reference, and the "
                         "sync reads whole parameters (not implemented)"),
    ]
    return [(sync, f"is set but {reason}") for refused, reason in why if refused][:1]


def records_routing(cfg: "RunConfig") -> bool:
    """Whether the rollout records each token's experts: routing replay, or its mismatch measured without it."""
    return cfg.loss.routing_replay or cfg.log.routing_mismatch


def routing_replay_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """Routing replay (or its measure, log.routing_mismatch) needs an engine that records each token's experts and a
    path that carries them to the update (the model being an MoE one is checked when it loads)."""
    if not (cfg.loss.routing_replay or cfg.log.routing_mismatch):
        return []
    key = "loss.routing_replay" if cfg.loss.routing_replay else "log.routing_mismatch"
    why = None
    if cfg.rollout.engine not in ("hf", "auto"):
        why = (f"needs rollout.engine hf (or auto, which then picks hf): {cfg.rollout.engine} does not record which "
               "experts it routed each token to")
    elif cfg.rollout.tools or cfg.rollout.environment or cfg.rollout.rollout_func:
        why = ("does not follow multi-turn rollouts yet (rollout.tools, rollout.environment, rollout.rollout_func): "
               "their later turns are prefilled from a cache whose routing is not recorded")
    elif cfg.train.deepspeed or cfg.train.fsdp:
        why = "is tested on one process's model and DDP only: drop train.deepspeed / train.fsdp"
    return [(key, why)] if why else []
