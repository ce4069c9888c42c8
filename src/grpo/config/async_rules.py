"""The checks of the asynchronous decoupled settings: weights loaded mid-generation
(``decoupled.weight_update: in_flight``) and partial rollouts (``decoupled.partial_rollouts``). Each returns
(key, problem) pairs, as ``grpo.config.rules``' checks do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.config.kinds import engine_traits

if TYPE_CHECKING:
    from grpo.config.schema import RunConfig


def in_flight_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """``decoupled.weight_update: in_flight`` needs an engine that loads weights between decode steps (full weights
    or a LoRA adapter, refolded when a newer one is loaded: ``grpo.rollout.folded_lora``; hf-static rewrites its
    sampling copy; vLLM reloads its own copy, full weights only), one turn per rollout (a tool round would re-read its conversation with other weights) and
    log-probs the engine can report as the trainer computes them (min_p renormalises over the kept tokens)."""
    if cfg.decoupled.weight_update != "in_flight":
        return []
    key, r = "decoupled.weight_update", cfg.rollout
    if cfg.train.mode != "decoupled":
        return [(key, "is in_flight but train.mode is colocated: the trainer's own model samples, with the newest "
                      "weights already; set train.mode: decoupled or decoupled.weight_update: per_chunk")]
    engine = engine_traits(r.engine)
    if r.engine != "auto" and not engine.in_flight:
        return [(key, f"is in_flight but rollout.engine is {r.engine}: it does not load weights between its decode "
                      "steps; use rollout.engine: hf, hf-static, vllm or decoupled.weight_update: per_chunk")]
    own = engine.own_weights  # vLLM: its per-token log-probs are its own, after top-k/top-p; adapters per call
    for bad, problem in ((bool(r.tools or r.environment or r.rollout_func), "the rollouts are multi-turn or a "
                          "rollout_func's: a turn would continue a conversation sampled with other weights"),
                         (r.min_p > 0, f"rollout.min_p is {r.min_p}: the engine's per-token log-probs would not be "
                                       "the trainer's (min_p renormalises over the kept tokens)"),
                         (own and (r.top_p < 1 or bool(r.top_k)), f"rollout.engine is {r.engine} with rollout.top_p "
                          f"{r.top_p} / top_k {r.top_k}: its per-token log-probs are renormalised over the kept "
                          "tokens, not the trainer's"),
                         (own and cfg.model.lora_r > 0, f"rollout.engine is {r.engine} with model.lora_r "
                          f"{cfg.model.lora_r}: it switches LoRA adapters only between generate calls")):
        if bad:
            return [(key, f"is in_flight but {problem}; set decoupled.weight_update: per_chunk")]
    return []


def partial_rollout_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """``decoupled.partial_rollouts`` carries unfinished groups from one chunk to the next: it needs the samplers
    (decoupled mode), an engine that records each token's version and log-prob (the in-flight engine's needs;
    vLLM's are its processed log-probs, the trainer's only without top-k/top-p),
    steps of whole but varying numbers of groups (no dynamic sampling, which fills a fixed count; several trainer
    ranks split a step as evenly as whole groups allow, under DeepSpeed each running as many micro-batches as the
    most: grpo.step.policy_update.LossSettings.equal_micro_batches), a budget that leaves something to carry, and a staleness bound a carried
    token can meet (at 0 every carried token is too old for the next step)."""
    d, r = cfg.decoupled, cfg.rollout
    if not d.partial_rollouts:
        return []
    key = "decoupled.partial_rollouts"
    engine = engine_traits(r.engine)
    checks = (
        (cfg.train.mode != "decoupled", "train.mode is colocated: there is no chunk to send early; set train.mode: "
                                        "decoupled"),
        (r.engine != "auto" and not engine.in_flight,
         f"rollout.engine is {r.engine}, which does not record each token's version and log-prob; use "
         "rollout.engine: hf, hf-static or vllm"),
        (engine.own_weights and (r.top_p < 1 or bool(r.top_k)),
         f"rollout.engine is {r.engine} with rollout.top_p {r.top_p} / top_k {r.top_k}: its per-token log-probs "
         "(a carried token's old log-prob) are renormalised over the kept tokens, not the trainer's"),
        (bool(r.tools or r.environment or r.rollout_func), "the rollouts are multi-turn or a rollout_func's: only a "
                                                           "single-turn completion is continued across chunks"),
        (r.min_p > 0, f"rollout.min_p is {r.min_p}: the engine's per-token log-probs would not be the trainer's"),
        (r.dynamic_sampling, "rollout.dynamic_sampling is on: it fills a fixed number of groups per step, and a "
                             "partial chunk holds the groups that finished"),
        (cfg.train.max_staleness < 1, "train.max_staleness is 0: a carried-over token would be too stale for the "
                                      "next step, so every carried group would start over; set it to 1 or more"),
        (d.partial_token_budget >= r.max_completion_length,
         f"decoupled.partial_token_budget {d.partial_token_budget} is not below rollout.max_completion_length "
         f"{r.max_completion_length}: nothing is ever carried over"),
    )
    return [(key, f"is true but {problem}") for bad, problem in checks if bad][:1]
