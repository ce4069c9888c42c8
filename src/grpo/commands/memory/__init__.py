"""``grpo memory CONFIG``: peak GPU memory per device of a run, before launching it.

Parts: the policy's weights, gradients and AdamW states (full or LoRA; bf16/fp32; mixed precision;
ZeRO-1/2/3 over N GPUs), activations (with or without gradient checkpointing), the logits and
log-softmax of a micro-batch, the reference model, a colocated vLLM's KV cache, and a CUDA
allowance. The formulas are in ``grpo.commands.memory.formulas`` (activations counted tensor by tensor as
autograd keeps them), ``grpo.commands.memory.phases`` (each phase of a step) and
``grpo.commands.memory.estimate`` (the peak).

The seeds' tables for Qwen2.5-3B on one GPU, reproduced (tests/test_memory.py), with gradient
checkpointing and micro-batches of 4 x (256 prompt + 512 completion) tokens:

- full fine-tuning, bf16, mixed-precision AdamW: 3.09B x (2 weights + 2 gradients + 12 fp32 master,
  m, v) = 46.0 GiB (49.4e9 bytes, the seeds' "3B x 16 = 48 GB") before activations; 52.0 GiB in all
  without a reference (loss.beta 0), 58.1 GiB with the bf16 reference copy: the quoted ~48-60 GB;
- LoRA r=16 on all linears (29.9M adapter parameters) over a frozen bf16 base: 5.75 GiB base +
  0.45 GiB of fp32 adapters, their gradients and AdamW states + 0.45 GiB activations + 2.6 GiB
  logits + allowance = 10.2 GiB: the quoted ~8-12 GB.

grpo's own torch path with ``model.bf16`` (full fine-tuning, no DeepSpeed) trains fp32 master weights
under bf16 autocast: 4 weights + 4 gradients + 8 AdamW = 16 B/param, the same total as the seeds'
mixed precision, split differently.
benchmarks/memory_check.py compares the estimate with the measured peak of real CPU training steps.
"""

from grpo.commands.memory.estimate import COMPONENTS, CudaAllowance, MemoryEstimate, estimate_memory, read_deepspeed
from grpo.commands.memory.report import format_table, run_memory_command
from grpo.commands.memory.shapes import BUILTIN_CONFIGS, ModelShape, load_model_config

__all__ = ["BUILTIN_CONFIGS", "COMPONENTS", "CudaAllowance", "MemoryEstimate", "ModelShape", "estimate_memory",
           "format_table", "load_model_config", "read_deepspeed", "run_memory_command"]
