"""Rollout engines: turn rendered prompts into groups of sampled completions.

An engine is anything with the ``RolloutEngine`` protocol, looked up by name in ``ENGINES``:
``hf`` (default) is a lean sampling loop over the HF model's KV cache; ``hf-static`` the same
distribution from a static cache with the decode step replayed as a CUDA graph, for GPUs;
``hf-generate`` is ``model.generate`` itself (same distribution, more per-token overhead).
"""

from grpo.rollout.engine import RolloutEngine, SamplingParams, completion_mask_from_ids
from grpo.rollout.hf import HFEngine
from grpo.rollout.lean import LeanEngine
from grpo.rollout.static import StaticEngine

ENGINES = {"hf": LeanEngine, "hf-static": StaticEngine, "hf-generate": HFEngine}


def make_engine(name: str, model, tokenizer, batch_size: int | None = None) -> RolloutEngine:
    """The engine called ``name`` over ``model``; an unknown name lists the known ones."""
    try:
        return ENGINES[name](model, tokenizer, batch_size)
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; known: {sorted(ENGINES)}") from None


__all__ = ["ENGINES", "HFEngine", "LeanEngine", "RolloutEngine", "SamplingParams", "StaticEngine",
           "completion_mask_from_ids", "make_engine"]
