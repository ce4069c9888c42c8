"""Errors the command line turns into a clear message and an exit status (kept import-light), and the
statuses themselves (the exit-status table of docs/reference/exit-codes.md is checked against these)."""
import sys

EXIT_OK = 0
EXIT_FAILED = 1  # training cannot go on: aborted, a peer timed out, the disk failed, an unexpected error
EXIT_BAD_INPUT = 2  # a configuration or input error (the message names the key, file or line)
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM, after a checkpoint of the last finished step


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message names the source, the key and why."""


class RewardError(ValueError):
    """A reward function broke its contract (wrong length, a non-number): the run cannot go on."""


class TrainingAborted(RuntimeError):
    """Training cannot continue (e.g. every update non-finite for several steps); checkpoints stay."""


class OffPolicySampling(TrainingAborted):
    """The rollout engine samples from weights that are not the policy's (its log-probs differ from the
    trainer's by more than rollout.vllm_max_logprob_diff): training on its samples would be off-policy."""


def exit_status(err: BaseException) -> tuple[int, str] | None:
    """``(status, one-line message)`` for an error the command line reports without a traceback; None for any
    other (a bug: its traceback is the report). The modules are looked up, not imported: an error of a module
    never imported cannot have been raised."""
    if isinstance(err, ConfigError):
        return EXIT_BAD_INPUT, f"grpo: configuration error: {err}"
    kinds = [("grpo.data", "DataError", EXIT_BAD_INPUT, "data error"),
             ("grpo.run.checkpoint", "CheckpointError", EXIT_BAD_INPUT, "checkpoint error")]
    for module, name, code, kind in kinds:
        error_type = getattr(sys.modules.get(module), name, None)
        if error_type is not None and isinstance(err, error_type):
            return code, f"grpo: {kind}: {err}"
    if isinstance(err, RewardError):
        return EXIT_BAD_INPUT, f"grpo: reward error: {err}"
    if isinstance(err, TrainingAborted):
        return EXIT_FAILED, f"grpo: training aborted: {err}"
    if isinstance(err, TimeoutError):  # a peer (trainer, sampler, server) stayed silent past its timeout
        return EXIT_FAILED, f"grpo: timed out: {err}"
    if isinstance(err, OSError):  # e.g. disk full while writing a checkpoint: earlier checkpoints are intact
        return EXIT_FAILED, (f"grpo: {err.strerror or err} ({err.filename or 'file system'}); files written before "
                             "are intact (checkpoints are written to a temporary folder and renamed)")
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "grpo: interrupted"
    return None
