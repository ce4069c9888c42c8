"""The off-policy guard: is the rollout engine sampling from the policy the trainer is training?

An engine with its own copy of the weights (vLLM) can drift from the policy without any error: a weight
push that did not land, a stale packed layer, another dtype or temperature. With one update per step
nothing else would show it (the ratio uses the trainer's log-probs, so it stays 1), and the run would
quietly train off-policy. So on checked steps the trainer compares the engine's log-prob of each
sampled token with its own, logs the mean gap as ``rollout/logprob_diff``, and stops the run when it
is above ``rollout.vllm_max_logprob_diff``, naming the step and the gap.

Which steps: the run's first two (the engine as loaded, then the first pushed weights: a broken setup
shows at once, not after ``every`` steps; after a resume, the first two of the resumed run), then every
``every``-th. The trainer's log-probs cost one extra no-grad forward pass on a checked step when a
step has one update (with more, ``loss.num_iterations`` x ``train.mini_batches``, the trainer computes
old log-probs every step anyway, and every step is checked for free).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.algorithm import logprob_mismatch
from grpo.errors import OffPolicySampling
from grpo.parallel.distributed import DistInfo, all_reduce_sum


def is_check_step(step: int, every: int, first_step: int = 1) -> bool:
    """True on the steps the guard checks: the first two this process runs (``first_step`` and the next:
    a resumed run builds and loads its engine anew), then multiples of ``every``; never when ``every`` is 0."""
    return every > 0 and (step < first_step + 2 or step % every == 0)


def check_sampler_logprobs(step: int, sampler_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor,
                           max_diff: float, info: DistInfo) -> dict[str, float]:
    """``{"rollout/logprob_diff": mean |sampler - trainer|}`` over the step's completion tokens on all ranks,
    or ``OffPolicySampling`` when it is above ``max_diff`` (or not a number).

    Args:
        sampler_logprobs: ``[N, L]`` the engine's log-probs of this rank's sampled tokens (any device).
        trainer_logprobs: ``[N, L]`` the trainer's, from the weights that sampled them (before the update).
        mask: ``[N, L]`` the sampled tokens (``Generation.sampled_mask``): an environment's tokens have no
            sampler log-prob to compare.
    All ranks get the same mean (sums and counts are added over ranks first), so they stop together.
    """
    device = trainer_logprobs.device
    total, count = logprob_mismatch(sampler_logprobs.to(device), trainer_logprobs, mask.to(device))
    total, count = all_reduce_sum(torch.stack([total, count]), info).tolist()
    diff = total / max(count, 1.0)
    if not diff <= max_diff:  # also stops on NaN, which compares False with everything
        raise OffPolicySampling(
            f"step {step}: the rollout engine's log-probs of its sampled tokens differ from the trainer's by "
            f"{diff:.4g} on average over {int(count)} tokens (rollout.vllm_max_logprob_diff {max_diff:g}): it "
            "is not sampling from the policy being trained (weights not synced, another dtype or temperature), "
            "and training on these samples would be off-policy. This batch was not trained on; the last "
            "checkpoint is intact.")
    return {"rollout/logprob_diff": diff}
