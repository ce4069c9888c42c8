"""The rules of the precision and compile settings (``model.fp16``, ``model.tf32``, ``train.torch_compile``):
which combinations a run cannot take, each as ``(key, why)`` like ``grpo.config.rules``' checks. What depends on
the device the run lands on (TF32 needs an Ampere GPU, a compile backend must exist) is checked where the device
is known: ``grpo.models.precision.check_precision``, ``grpo.models.compiled.check_compile``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.algorithm import advantage_estimator

if TYPE_CHECKING:
    from grpo.config.schema import RunConfig


def fp16_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """model.fp16 against the other precision and the parts that have no loss scaler."""
    if not cfg.model.fp16:
        return []
    problems = []
    if cfg.model.bf16:
        problems.append(("model.fp16", "cannot be combined with model.bf16: a run computes in one half-precision "
                                       "type (TRL: at most one of fp16 and bf16); drop one"))
    if cfg.model.load_in_4bit:
        problems.append(("model.fp16", (
            "cannot be combined with model.load_in_4bit yet: the 4-bit base's float16 compute dtype, peft's k-bit "
            "preparation and the loss scaler have not been run together (bitsandbytes needs a GPU this project "
            "was not tested on); use model.bf16 for QLoRA")))
    if advantage_estimator(cfg.algorithm.advantage_estimator).needs_critic:
        problems.append(("model.fp16", (
            "cannot be combined with algorithm.advantage_estimator gae yet: the critic's update has no loss scaler, "
            "and its float16 gradients would underflow unscaled; use fp32 or model.bf16 for PPO")))
    if cfg.train.fsdp:
        problems.append(("model.fp16", (
            "cannot be combined with train.fsdp yet: FSDP2's sharded gradients need a sharded loss scaler that "
            "grpo's FSDP2 learner does not have; use model.bf16 (FSDP2's mixed precision) or DDP")))
    if cfg.train.mode == "decoupled":
        problems.append(("model.fp16", (
            "cannot be combined with train.mode decoupled yet: the samplers load the policy in the training "
            "dtype and run it without autocast, which for float16 would be pure half-precision inference (norms "
            "and softmax included), not the trainer's mixed precision; use colocated mode or model.bf16")))
    return problems


def tf32_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """model.tf32 on a device named as the CPU (``auto`` is checked when the run knows its device)."""
    if cfg.model.tf32 and cfg.train.device == "cpu":
        return [("model.tf32", "is true but train.device is cpu: TF32 is a matmul mode of Ampere and newer CUDA "
                               "GPUs (transformers: --tf32 requires Ampere or a newer GPU arch); set it to null")]
    return []


def compile_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """train.torch_compile's backend and mode need it on, and it runs on grpo's torch learner only."""
    t, problems = cfg.train, []
    for key in ("torch_compile_backend", "torch_compile_mode"):
        if getattr(t, key) is not None and not t.torch_compile:
            problems.append((f"train.{key}", f"is {getattr(t, key)!r} but train.torch_compile is false: set "
                                             "train.torch_compile: true (TRL turns it on for you) or drop it"))
    if t.torch_compile and t.deepspeed:
        problems.append(("train.torch_compile", (
            "cannot be combined with train.deepspeed: the compiled decoder is swapped in by grpo's torch learner "
            "around each micro-batch, and a DeepSpeed engine runs the model itself (ZeRO-3 gathers its "
            "parameters in hooks); drop one")))
    if t.torch_compile and t.fsdp:
        problems.append(("train.torch_compile", (
            "cannot be combined with train.fsdp yet: the compiled decoder is swapped in by grpo's torch learner, "
            "and FSDP2's learner runs its sharded modules with their own hooks; drop one")))
    return problems


SPEED_RULES = (fp16_problems, tf32_problems, compile_problems)
