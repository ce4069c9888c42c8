"""The critic's part of a run checkpoint: ``checkpoints/step-N/critic/`` holds its body (HF format, or
the LoRA adapter), ``value_head.safetensors``, ``optimizer.pt`` and ``scheduler.pt``.

Written inside the policy checkpoint's temporary folder (``grpo.run.checkpoint.save_checkpoint``'s
``write_extra``), so the step's folder appears with both or neither. Loading raises ``CheckpointError``
naming the file, like the policy's.
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

from grpo.critic.critic_update import Critic
from grpo.critic.value_model import VALUE_HEAD_FILE, load_value_head
from grpo.run.checkpoint import (
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    CheckpointError,
    _is_peft,
    _load_adapter,
    _load_full_model,
    _load_state_dict_into,
    _save_model,
)

CRITIC_DIR = "critic"


def save_critic(folder: Path, critic: Critic) -> None:
    """Write the critic's weights, optimizer and schedule into ``folder`` (created here)."""
    folder.mkdir()
    _save_model(critic.model.body, folder)
    head = {k: v.detach().cpu().contiguous() for k, v in critic.model.value_head.state_dict().items()}
    safetensors.torch.save_file(head, folder / VALUE_HEAD_FILE)
    torch.save(critic.optimizer.state_dict(), folder / OPTIMIZER_FILE)
    torch.save(critic.scheduler.state_dict(), folder / SCHEDULER_FILE)


def load_critic(folder: Path, critic: Critic) -> None:
    """Restore what ``save_critic`` wrote into ``critic`` in place."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is missing: this checkpoint was saved without a critic (by a run whose "
                              "algorithm.advantage_estimator was not gae), so PPO cannot resume from it")
    body = critic.model.body
    if _is_peft(body):
        _load_adapter(folder, body)
    else:
        _load_full_model(folder, body)
    load_value_head(critic.model, folder / VALUE_HEAD_FILE)
    _load_state_dict_into(critic.optimizer, folder / OPTIMIZER_FILE)
    _load_state_dict_into(critic.scheduler, folder / SCHEDULER_FILE)
