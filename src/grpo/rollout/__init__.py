"""Rollout engines: turn rendered prompts into groups of sampled completions.

An engine is anything with the ``RolloutEngine`` protocol; the config names one of ``grpo.rollout.build.ENGINES``:
``hf`` (the default on a CPU) is a lean sampling loop over the HF model's KV cache; ``hf-static`` (the
default on CUDA: ``auto``, ``grpo.config.device_defaults``) the same distribution from a static cache with
the decode step replayed as a CUDA graph;
``hf-generate`` is ``model.generate`` itself (same distribution, more per-token overhead); ``vllm`` an
``OwnWeightsEngine`` (``grpo.rollout.vllm_engine``).
"""

from grpo.rollout.engine import OwnWeightsEngine, RolloutEngine, SamplingParams, completion_mask_from_ids
from grpo.rollout.hf import HFEngine
from grpo.rollout.lean import LeanEngine
from grpo.rollout.static import StaticEngine

__all__ = ["HFEngine", "LeanEngine", "OwnWeightsEngine", "RolloutEngine", "SamplingParams", "StaticEngine",
           "completion_mask_from_ids"]
