"""PPO's critic: a causal LM body with a scalar value head, and the values of a generation's tokens.

Convention (TRL's PPOTrainer, OpenRLHF's Critic): the value of completion token ``t`` is read at the
position that *predicts* it, i.e. the hidden state after the prompt and completion tokens ``< t``; it
is ``V(s_t)``, the value of the state before token ``t`` is chosen, which is what
``grpo.algorithm.gae_advantages`` takes. For a left-padded prompt of width ``Lp`` that position is
``Lp - 1 + t`` of the concatenated sequence.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor
from transformers import AutoModel

from grpo.config import ConfigError, CriticConfig, ModelConfig
from grpo.models.loading import policy_dtype
from grpo.run.checkpoint import CheckpointError, _read_safetensors
from grpo.step.logprobs import checkpointing_paused, position_ids_from_mask

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(torch.nn.Module):
    """``body`` (a transformers base model, e.g. ``Qwen2Model``, or a peft wrapper of one) and a
    ``Linear(hidden, 1)`` head. The head is float32 and runs outside autocast: value targets are
    returns of a few units whose small differences matter."""

    def __init__(self, body: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        # Zero: every value starts at 0, so the first advantages are the plain (discounted, lam-mixed)
        # returns; a random head would start from noise of the hidden states' scale instead. The price: the
        # body's gradient is 0 in the first update (it flows through the head), so the body moves from the second.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """[B, T] ids, mask, positions -> [B, T] float32 value at each position (of the prefix ending there)."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state  # [B, T, H]
        with torch.autocast(hidden.device.type, enabled=False):
            return self.value_head(hidden.float()).squeeze(-1)  # [B, T]


def _enable_checkpointing(body: torch.nn.Module) -> None:
    if hasattr(body, "activation_checkpointing_enable"):  # transformers >= 5.2x name, as models.load_policy
        body.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def critic_dtype(critic: CriticConfig, model: ModelConfig) -> torch.dtype:
    """float32 (full fine-tuning: master weights; bf16 compute comes from the run's autocast when
    ``model.bf16``), or the policy's dtype for a LoRA critic's frozen body."""
    return policy_dtype(model) if critic.lora_r > 0 else torch.float32


def load_value_model(critic: CriticConfig, model: ModelConfig, device: torch.device) -> ValueModel:
    """The trainable critic on ``device``: the body of ``critic.name_or_path`` (null: the policy's
    ``model.name_or_path``) loaded with ``AutoModel`` (a causal LM's ``lm_head`` is left out), LoRA
    when ``critic.lora_r > 0`` (the value head is always trained), gradient checkpointing as asked.
    A folder holding ``value_head.safetensors`` (a grpo checkpoint's ``critic/``) gives its head too;
    otherwise the head starts at zero."""
    name = critic.name_or_path or model.name_or_path
    key = "critic.name_or_path" if critic.name_or_path else "model.name_or_path"
    local = Path(name).expanduser()
    if (name.startswith((".", "/", "~")) or name.count("/") != 1) and not local.exists():
        raise ConfigError(f"{key}: {name!r} does not exist (a local folder or a hub id org/name)")
    kwargs = {"dtype": critic_dtype(critic, model), "trust_remote_code": model.trust_remote_code}
    if model.attn_implementation:
        kwargs["attn_implementation"] = model.attn_implementation
    body = AutoModel.from_pretrained(name, **kwargs)
    hidden = getattr(body.config, "hidden_size", None)
    if not isinstance(hidden, int):
        raise ConfigError(f"{key}: {name!r} has no integer config.hidden_size for the value head")
    if critic.gradient_checkpointing:
        _enable_checkpointing(body)
        body.config.use_cache = False
    if critic.lora_r > 0:
        if critic.gradient_checkpointing:
            body.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need grads
        body = get_peft_model(body, LoraConfig(r=critic.lora_r, lora_alpha=critic.lora_alpha,
                                               lora_dropout=critic.lora_dropout,
                                               target_modules=critic.lora_target_modules))
    value_model = ValueModel(body, hidden)
    head_file = local / VALUE_HEAD_FILE
    if head_file.is_file():
        load_value_head(value_model, head_file)
    value_model.to(device)
    value_model.train()
    return value_model


def load_value_head(value_model: ValueModel, file: Path) -> None:
    """Read ``value_head.safetensors`` into the head; a missing, corrupt or misfit file raises
    ``CheckpointError`` naming it."""
    state = _read_safetensors(file)
    try:
        value_model.value_head.load_state_dict(state)
    except RuntimeError as err:  # other keys or another hidden size
        raise CheckpointError(f"{file} does not fit the value head: {err}") from err


def completion_values(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                      completion_mask: Tensor) -> Tensor:
    """Values of the states before each completion token (see the module docstring).

    Args:
        model: a ``ValueModel`` (or a DDP wrapper of one).
        prompt_ids, prompt_mask: ``[b, Lp]``, left-padded.
        completion_ids, completion_mask: ``[b, Lc]``, right-padded.

    Returns:
        ``[b, Lc]`` float32 on the model's device; 0 in the columns past the longest completion (the
        pass skips them), finite elsewhere on padding. Gradients flow when grad is enabled.
    """
    device = next(model.parameters()).device
    Lp, Lc = prompt_ids.shape[1], completion_ids.shape[1]
    width = int(completion_mask.sum(-1).max()) if completion_mask.numel() else 0  # columns with a real token
    if width == 0:
        return torch.zeros(completion_ids.shape, dtype=torch.float32, device=device)
    ids = torch.cat([prompt_ids, completion_ids[:, :width]], dim=1).to(device)  # [b, Lp + width]
    mask = torch.cat([prompt_mask, completion_mask[:, :width]], dim=1).to(device)  # [b, Lp + width]
    values = model(ids, mask, position_ids_from_mask(mask))  # [b, Lp + width]
    picked = values[:, Lp - 1:Lp - 1 + width]  # [b, width]: positions that predict completion tokens 0..width-1
    return torch.nn.functional.pad(picked, (0, Lc - width))  # [b, Lc]


def generation_values(model: torch.nn.Module, generation, batch_size: int) -> Tensor:
    """[N, Lc] values of a ``Generation``'s completion tokens, without gradients, ``batch_size`` rows a pass
    (gradient checkpointing paused: there is no backward to save memory for)."""
    values = []
    with torch.no_grad(), checkpointing_paused(model):
        for start in range(0, generation.prompt_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            values.append(completion_values(model, generation.prompt_ids[rows], generation.prompt_mask[rows],
                                            generation.completion_ids[rows], generation.completion_mask[rows]))
    return torch.cat(values)


__all__ = ["VALUE_HEAD_FILE", "ValueModel", "completion_values", "critic_dtype", "generation_values",
           "load_value_head", "load_value_model"]
