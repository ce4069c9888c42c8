"""PPO's critic in the memory estimate (``algorithm.advantage_estimator: gae``, ``grpo.critic``).

The critic is a causal LM body without its LM head plus a ``hidden -> 1`` value head. Its weights and
AdamW states stay on the device through every phase; its gradients and activations exist only in its
own update, which runs after the policy's (whose gradients are freed by then), one micro-batch of
``micro_batch_size`` full prompt + completion sequences at a time (no shared-prompt pass, no logits).

Bytes per parameter as ``grpo.critic`` trains it: full fine-tuning keeps fp32 weights (bf16 compute under
the run's autocast when ``model.bf16``): 4 + 4 + 8 = 16 B; a LoRA critic keeps its frozen body in the
policy's dtype and trains fp32 adapters (16 B each). The value head is fp32 and trained (16 B/param).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from grpo.algorithm import advantage_estimator
from grpo.commands.memory.formulas import activation_bytes, autocast_extra_bytes
from grpo.commands.memory.shapes import ModelShape, load_model_config, lora_targets
from grpo.commands.memory.states import _count, model_states
from grpo.config import RunConfig


@dataclass(frozen=True)
class CriticMemory:
    """Bytes per device of the critic: ``states`` (weights + AdamW, held in every phase), and its update's
    ``gradients`` and ``activations``; ``how`` says how they were counted."""

    states: float
    gradients: float
    activations: float
    how: str


def critic_memory(cfg: RunConfig, *, policy_shape: ModelShape, gpus: int, attention: str,
                  critic_config: dict | None = None) -> CriticMemory | None:
    """The critic of a run whose estimator needs one (gae; None for the others). ``critic_config``: the config.json
    of ``critic.name_or_path`` (default: read it; the policy's shape when that key is null)."""
    if not advantage_estimator(cfg.algorithm.advantage_estimator).needs_critic:
        return None
    c = cfg.critic
    shape = policy_shape
    if c.name_or_path is not None:
        if critic_config is None:
            critic_config, _ = load_model_config(c.name_or_path, "critic.name_or_path")
        shape = ModelShape.from_config(critic_config, c.name_or_path)
    # The body: embeddings, layers and final norm; counted as a tied model has them (no separate LM head).
    body = replace(shape, tie_word_embeddings=True)
    lora = c.lora_r > 0
    targets = lora_targets(c.lora_target_modules, shape) if lora else None
    compute = 2 if cfg.model.bf16 else 4
    states = model_states(body, p=compute if lora else 4, lora_r=c.lora_r, targets=targets, mixed_precision=False,
                          gpus=gpus, deepspeed=None)
    head = body.hidden_size + 1
    head_grads = head * 4 * (2 if gpus > 1 else 1)  # DDP's bucket copy, as model_states counts
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    b = cfg.train.micro_batch_size
    activations = activation_bytes(body, micro_batch=b, seq_len=seq_len, p=compute, lora_targets=targets,
                                   lora_r=c.lora_r, attention=attention,
                                   gradient_checkpointing=c.gradient_checkpointing)
    if cfg.model.bf16 and not lora:
        # fp32 master weights under bf16 autocast, as the policy's: autocast's bf16 weight copies live from
        # the critic's forward to its optimizer step (then cleared), so they count in its update only.
        copies, wider = autocast_extra_bytes(body, tokens=b * seq_len, gradient_checkpointing=c.gradient_checkpointing)
        activations += copies + wider
    how = (f"critic body {_count(body.num_params())} params" + (f", LoRA r={c.lora_r}" if lora else ", full fp32")
           + f" + value head; its update: {b} x {seq_len} tokens"
           + (", checkpointed" if c.gradient_checkpointing else ""))
    return CriticMemory(states=states.weights + head * 4 + states.optimizer + head * 8, gradients=states.gradients + head_grads,
                        activations=activations, how=how)
