"""Errors the command line turns into a clear message and an exit status (kept import-light)."""


class RewardError(ValueError):
    """A reward function broke its contract (wrong length, a non-number): the run cannot go on."""


class TrainingAborted(RuntimeError):
    """Training cannot continue (e.g. every update non-finite for several steps); checkpoints stay."""


class OffPolicySampling(TrainingAborted):
    """The rollout engine samples from weights that are not the policy's (its log-probs differ from the
    trainer's by more than rollout.vllm_max_logprob_diff): training on its samples would be off-policy."""
