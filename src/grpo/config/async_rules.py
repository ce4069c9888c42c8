"""The checks of the asynchronous decoupled settings: weights loaded mid-generation
(``decoupled.weight_update: in_flight``) and partial rollouts (``decoupled.partial_rollouts``). Each returns
(key, problem) pairs, as ``grpo.config.rules``' checks do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.config.kinds import engine_traits

if TYPE_CHECKING:
    from grpo.config.schema import RunConfig


TRUNCATED = ("rollout.engine is {engine} with rollout.top_p {top_p} / top_k {top_k} and loss.sampler_is_correction "
             "off: its per-token log-probs (then the ratio's old log-probs) are renormalised over the kept tokens, "
             "not the trainer's; set loss.sampler_is_correction: true (they are then the importance weight's "
             "sampling probabilities, as the truncated sampling drew them) or sample without top_p/top_k")


def truncated_without_correction(cfg: "RunConfig") -> bool:
    """An engine that reports its own per-token log-probs (vLLM: after top-k/top-p, renormalised over the kept
    tokens) samples truncated, and they would be the ratio's old log-probs (no ``loss.sampler_is_correction``).
    With the correction on the trainer takes its own old log-probs and vLLM's are the sampling probabilities of
    the importance weight, where the truncation belongs."""
    r = cfg.rollout
    return (engine_traits(r.engine).own_weights and (r.top_p < 1 or bool(r.top_k))
            and not cfg.loss.sampler_is_correction)


def in_flight_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """``decoupled.weight_update: in_flight`` needs an engine that loads weights between decode steps (full weights
    or a LoRA adapter, refolded when a newer one is loaded: ``grpo.rollout.folded_lora``; hf-static rewrites its
    sampling copy; vLLM reloads its own copy, or re-admits the open rows under a newer adapter:
    ``grpo.rollout.vllm_in_flight``), one turn per rollout (a tool round would re-read its conversation with other
    weights) and log-probs the engine can report as the trainer computes them (min_p renormalises over the kept
    tokens; vLLM's log-probs under top-k/top-p do too, which only the sampler correction takes:
    ``truncated_without_correction``)."""
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
    for bad, problem in ((bool(r.tools or r.environment or r.rollout_func), "the rollouts are multi-turn or a "
                          "rollout_func's: a turn would continue a conversation sampled with other weights"),
                         (r.min_p > 0, f"rollout.min_p is {r.min_p}: the engine's per-token log-probs would not be "
                                       "the trainer's (min_p renormalises over the kept tokens)"),
                         (truncated_without_correction(cfg), TRUNCATED.format(engine=r.engine, top_p=r.top_p,
                                                                              top_k=r.top_k))):
        if bad:
            return [(key, f"is in_flight but {problem}; set decoupled.weight_update: per_chunk")]
    return []


def partial_rollout_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """``decoupled.partial_rollouts`` carries unfinished groups from one chunk to the next: it needs the samplers
    (decoupled mode), an engine that records each token's version and log-prob (the in-flight engine's needs;
    vLLM's are its processed log-probs, the trainer's only without top-k/top-p: ``truncated_without_correction``),
    steps of whole but varying numbers of groups (no dynamic sampling, which fills a fixed count; several trainer
    ranks split a step as evenly as whole groups allow, under DeepSpeed each running as many micro-batches as the
    most: grpo.step.update_inputs.LossSettings.equal_micro_batches), a budget that leaves something to carry, and a staleness bound a carried
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
        (truncated_without_correction(cfg), TRUNCATED.format(engine=r.engine, top_p=r.top_p, top_k=r.top_k)),
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
