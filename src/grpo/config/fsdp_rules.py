"""The rules of ``train.fsdp`` and the ``fsdp`` section against the rest of the tree (``grpo.config.rules`` calls
them with the others). What only the model can say (its layer classes) and the installed torch are checked when
the learner is built (``grpo.parallel.fsdp``), still before anything is written."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.config.kinds import engine_traits

if TYPE_CHECKING:
    from grpo.config.schema import RunConfig


def fsdp_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """``(key, why)`` for each combination FSDP2 cannot run (empty when valid)."""
    if not cfg.train.fsdp:
        if cfg.fsdp != type(cfg.fsdp)():
            return [("fsdp", "keys are set but train.fsdp is false: they configure FSDP2's sharding; set "
                             "train.fsdp: true or drop the fsdp keys")]
        return []
    problems = []
    if cfg.train.deepspeed:
        problems.append(("train.fsdp", "cannot be combined with train.deepspeed: both shard the policy over the "
                                       "ranks (FSDP2 or ZeRO), and one model has one owner; pick one"))
    if cfg.model.load_in_4bit or cfg.optim.optimizer == "adamw_8bit":
        problems.append(("train.fsdp", "cannot be combined with model.load_in_4bit or optim.optimizer adamw_8bit: "
                                       "bitsandbytes' packed weights and 8-bit states are not tensors FSDP2 can "
                                       "shard; use full precision (or train.deepspeed: false, no FSDP2)"))
    if cfg.train.mode == "colocated" and engine_traits(cfg.rollout.engine).sampling_copy:
        problems.append(("train.fsdp", (
            f"cannot be combined with rollout.engine {cfg.rollout.engine} in colocated mode: its sampling copy is "
            "made from the policy's modules, which FSDP2 shards over the ranks; use rollout.engine hf (auto picks "
            "it under FSDP2) or train.mode decoupled (samplers load the published weights)")))
    if cfg.train.mode == "colocated" and engine_traits(cfg.rollout.engine).own_weights:
        problems.append(("train.fsdp", (
            f"cannot be combined with rollout.engine {cfg.rollout.engine} in colocated mode yet: that engine keeps "
            "its own copy of the weights, pushed from the policy's tensors after each update, and under FSDP2 "
            "those are each rank's shards; use rollout.engine hf (it samples from the gathered policy) or "
            "train.mode decoupled (samplers load the published weights)")))
    return problems
