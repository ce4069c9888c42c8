"""Errors the command line turns into a clear message and an exit status (kept import-light)."""


class RewardError(ValueError):
    """A reward function broke its contract (wrong length, a non-number): the run cannot go on."""


class TrainingAborted(RuntimeError):
    """Training cannot continue (e.g. every update non-finite for several steps); checkpoints stay."""
