"""How a log-prob pass runs (``LogprobPass``: the shared prompt pass, the column bucket, the fused head, packing) and
what a device type chooses where a choice is left open (``grpo.config.device_defaults``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.config.device_defaults import fused_head_by_size, pass_defaults


@dataclass(frozen=True)
class LogprobPass:
    """How the log-prob passes run (``train.shared_prompt_pass``, ``train.column_bucket``); None: the
    device type's default (``pass_choices``)."""

    share_prompts: bool | None = None  # each micro-batch's distinct prompts run once (the module docstring)
    column_bucket: int | None = None  # run widths rounded up to a multiple of this
    fused_head: bool | None = None  # log-probs from the hidden states, no [b, L, V] logits (None: by size)
    pack: bool = False  # each micro-batch's rows as one packed sequence, no padding (``_packed_scores``)


DEVICE_DEFAULT_PASS = LogprobPass()  # every choice the device type's default


def uses_fused_head(fused_head: bool | None, rows: int, positions: int, vocab_size: int,
                    device_type: str = "cpu", grad: bool = True) -> bool:
    """Whether a micro-batch of ``rows`` x ``positions`` scored positions runs the fused head: as given,
    or (None) when its logits would reach the device type's size for a pass with or without gradients
    (``grpo.config.device_defaults.PASS_DEFAULTS``)."""
    return fused_head_by_size(fused_head, rows=rows, positions=positions, vocab_size=vocab_size,
                              device_type=device_type, grad=grad)


def pass_choices(device: torch.device, share_prompts: bool | None, column_bucket: int | None) -> tuple[bool, int]:
    """(share prompts, column bucket) for a pass on ``device``: the values given, each None replaced by
    the device type's default (``grpo.config.device_defaults.PASS_DEFAULTS``)."""
    defaults = pass_defaults(device.type)
    return (defaults.share_prompts if share_prompts is None else share_prompts,
            defaults.column_bucket if column_bucket is None else column_bucket)
