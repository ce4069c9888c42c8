"""The precision a run computes in: the half type autocast runs (``model.bf16``, ``model.fp16``), fp16's loss
scaler, TF32 matmuls (``model.tf32``), and the checks of these settings against the device the run landed on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from grpo.config import ConfigError, ModelConfig

# transformers' words (TrainingArguments(tf32=True) without a TF32 GPU raises this), so that GRPOConfig says the same
TF32_UNAVAILABLE = "--tf32 requires Ampere or a newer GPU arch, cuda>=11 and torch>=1.7"


def autocast_dtype(cfg: ModelConfig) -> torch.dtype | None:
    """The half type the run's compute is cast to (``model.bf16``/``model.fp16``); None for fp32."""
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None


def uses_autocast(cfg: ModelConfig, deepspeed: bool) -> bool:
    """Half-precision compute over fp32 weights through ``torch.autocast``, on grpo's torch path (DeepSpeed keeps
    its own fp32 master copy and casts the model itself). bf16: full fine-tuning (AdamW updates smaller than a
    bf16 weight's resolution are kept); a LoRA run trains fp32 adapters over a bf16 base instead. fp16: always,
    LoRA included: float16's narrow range needs autocast's fp32 norms and softmax, and the base stays fp32."""
    if deepspeed or cfg.load_in_4bit:
        return False
    return cfg.fp16 or (cfg.bf16 and cfg.lora_r == 0)


def tf32_available() -> bool:
    """Whether this machine can run TF32 matmuls: a CUDA build and an Ampere (sm80) or newer GPU, as
    transformers' ``is_torch_tf32_available`` decides."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_properties(torch.cuda.current_device()).major >= 8


def check_precision(cfg: ModelConfig, device: torch.device) -> None:
    """ConfigError (before anything is written) for a precision the run's ``device`` cannot compute in."""
    if cfg.tf32 and (device.type != "cuda" or not tf32_available()):
        raise ConfigError(f"model.tf32: {TF32_UNAVAILABLE}; this run is on {device.type} (set model.tf32: null)")
    if cfg.fp16 and not torch.amp.is_autocast_available(device.type):
        raise ConfigError(f"model.fp16: torch has no autocast for {device.type} devices; use cuda or cpu")


@contextmanager
def tf32_mode(setting: bool | None) -> Iterator[None]:
    """TF32 matmuls and cuDNN convolutions on (True) or off (False) inside the block, as transformers'
    ``enable_tf32`` sets them (torch's generic fp32 precision, which the cuBLAS and cuDNN settings inherit),
    and the previous value back after it; None changes nothing."""
    if setting is None:
        yield
        return
    previous = torch.backends.fp32_precision
    torch.backends.fp32_precision = "tf32" if setting else "ieee"
    try:
        yield
    finally:
        torch.backends.fp32_precision = previous


def loss_scaler(cfg: ModelConfig, device: torch.device, deepspeed: bool) -> torch.amp.GradScaler | None:
    """fp16's dynamic loss scaler on grpo's torch path (torch's defaults: 2^16 at start, halved after an overflow,
    doubled after 2,000 clean updates); None otherwise (DeepSpeed scales in its engine, fp32/bf16 need none)."""
    if not cfg.fp16 or deepspeed:
        return None
    return torch.amp.GradScaler(device.type)
