"""Rollout engines: turn rendered prompts into groups of sampled completions.

An engine is anything with the ``RolloutEngine`` protocol; HF ``generate`` is the CPU default.
"""

from grpo.rollout.base import RolloutEngine, SamplingParams, completion_mask_from_ids
from grpo.rollout.hf import HFEngine

__all__ = ["RolloutEngine", "SamplingParams", "completion_mask_from_ids", "HFEngine"]
