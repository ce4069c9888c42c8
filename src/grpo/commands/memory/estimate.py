"""Peak memory per device of a run's config: model states, activations, logits, reference, KV cache.

A step has three phases whose transients never overlap (four with PPO's critic, ``grpo.commands.memory.critic``;
one more with the PTX loss; each phase's bytes: ``grpo.commands.memory.phases``): the rollout (sampling with a
KV cache, then no-grad reference/old log-probs), the update (forward and backward of each micro-batch, gradients
accumulating), and the optimizer step. The peak is the largest phase plus the CUDA allowance. The
reported components are those of the update phase; ``peak_phase`` says when another phase is larger.

Model states (bytes per parameter; ZeRO divides optimizer (stage 1), + gradients (2), + weights (3)
over the GPUs, as in the ZeRO paper):

- full fine-tuning, mixed precision (DeepSpeed with bf16, and what the seeds' tables assume):
  2 weights + 2 gradients + 12 AdamW (fp32 master, m, v) = 16 B; Qwen2.5-3B (3.09B params): 46.0 GB;
- full fine-tuning, ``model.bf16`` without DeepSpeed (grpo's torch path): fp32 master weights under
  bf16 autocast: 4 + 4 + 8 = 16 B, activations in bf16;
- fp32: 4 + 4 + 8 = 16 B;
- LoRA: the frozen base in the compute dtype, adapters (r x (in + out) per adapted linear) in fp32
  with fp32 gradients and AdamW m, v: 16 B per adapter parameter.

GB here are GiB (2^30 bytes), as torch.cuda and nvidia-smi count them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from grpo.commands.memory.critic import critic_memory
from grpo.commands.memory.formulas import LORA_BYTES, sampling_copy_bytes
from grpo.commands.memory.fsdp_states import fsdp_model_states
from grpo.commands.memory.phases import (
    GIB,
    RunSizing,
    UpdatePass,
    gb,
    reference_bytes,
    rollout_transient_bytes,
    run_sizing,
    step_phases,
    update_pass,
    vllm_hold,
)
from grpo.commands.memory.states import ModelStates, model_states, read_deepspeed  # noqa: F401 (the package's)
from grpo.config import ConfigError, RunConfig
from grpo.config.device_defaults import resolve_engine_name

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "reference", "critic", "kv_cache",
              "overhead")


@dataclass(frozen=True)
class CudaAllowance:
    """What a CUDA device holds beyond tensors (set ``device="cpu"`` in ``estimate_memory`` for none)."""

    context_gb: float = 0.5  # CUDA context + cuBLAS workspaces (torch 2.x with lazy module loading)
    nccl_gb: float = 0.5  # NCCL communicators and buffers, with more than one GPU
    fragmentation: float = 0.05  # the caching allocator reserves more than is live; GRPO's lengths vary


@dataclass
class MemoryEstimate:
    """Estimated peak memory of one device (GiB).

    per_device_gb: the update phase's parts (weights, gradients, optimizer, activations, logits,
        reference, kv_cache) and overhead; they sum to ``total_gb`` unless ``peak_phase`` is another.
    total_gb: the largest phase plus overhead. fits: total_gb <= gpu_gb, None when gpu_gb is unknown.
    phases_gb: each phase's tensors (rollout, update, optimizer_step), without overhead.
    how: one line per component saying how it was counted. assumptions: the numbers it rests on.
    sampler_gb: decoupled mode, the tensors of one sampler device (weights, reference, KV cache); None otherwise.
    """

    per_device_gb: dict[str, float]
    total_gb: float
    fits: bool | None
    notes: list[str] = field(default_factory=list)
    assumptions: dict[str, object] = field(default_factory=dict)
    phases_gb: dict[str, float] = field(default_factory=dict)
    peak_phase: str = "update"
    how: dict[str, str] = field(default_factory=dict)
    gpus: int = 1
    gpu_gb: float | None = None
    sampler_gb: float | None = None

    def to_json(self) -> dict:
        """The ``grpo memory --json`` object."""
        return {"per_device_gb": self.per_device_gb, "total_gb": self.total_gb, "fits": self.fits,
                "gpus": self.gpus, "gpu_gb": self.gpu_gb, "peak_phase": self.peak_phase,
                "phases_gb": self.phases_gb, "sampler_gb": self.sampler_gb, "notes": self.notes,
                "assumptions": self.assumptions}


def estimate_memory(cfg: RunConfig, *, gpus: int | None = None, gpu_gb: float | None = None,
                    model_config: dict | None = None, vllm_gpu_memory_utilization: float | None = None,
                    ref_model_config: dict | None = None, mixed_precision: bool | None = None,
                    critic_config: dict | None = None,
                    device: str = "cuda", allowance: CudaAllowance = CudaAllowance()) -> MemoryEstimate:
    """Estimate the peak memory per device of training ``cfg``.

    gpus: devices the run is spread over (default: decoupled.trainer_ranks in decoupled mode, else 1).
    gpu_gb: memory of one device (GiB) for ``fits``. model_config / ref_model_config: config.json dicts
        (default: read from model.name_or_path / model.ref_name_or_path, see ``load_model_config``).
    critic_config: config.json of critic.name_or_path (PPO, gae) when given; default: read it.
    mixed_precision: AdamW with fp32 master weights and fp32 m, v (None: as grpo runs the config, i.e.
        only under DeepSpeed with bf16). vllm_gpu_memory_utilization: share of gpu_gb a colocated vLLM
        reserves (used when rollout.engine is vllm). device: "cuda", or "cpu" for no CUDA allowance and
        torch's per-tensor (not foreach) AdamW on CPU.
    Raises ConfigError when a model's config cannot be found or an argument is out of range.
    """
    _check_arguments(gpus, gpu_gb, vllm_gpu_memory_utilization)
    run, source = run_sizing(cfg, gpus=gpus, model_config=model_config, mixed_precision=mixed_precision,
                             device=device)
    shape, p = run.shape, run.p
    if run.fsdp:
        states = fsdp_model_states(shape, p=p, lora_r=cfg.model.lora_r, targets=run.targets, gpus=run.gpus,
                                   cpu_offload=cfg.fsdp.cpu_offload, device=device,
                                   reshard_after_forward=cfg.fsdp.reshard_after_forward,
                                   accumulate_unsharded=cfg.fsdp.accumulate_unsharded)
    else:
        states = model_states(shape, p=4 if run.autocast else p, lora_r=cfg.model.lora_r, targets=run.targets,
                              mixed_precision=run.mixed_precision, gpus=run.gpus, deepspeed=run.ds,
                              base_4bit=cfg.model.load_in_4bit, optimizer_8bit=cfg.optim.optimizer == "adamw_8bit")
    update = update_pass(run, states.trained_params)
    notes, how = [f"model shape from {source}", *update.notes], {**states.how, **update.how}
    if run.autocast:
        states = replace(states, weights=states.weights + update.weight_copies)
        how["weights"] = states.how["weights"] + " + autocast's bf16 copies of the layer linears (2 B each)"
    reference, how["reference"] = reference_bytes(cfg, n_params=shape.num_params(), p=p,
                                                  ref_model_config=ref_model_config)
    sampler_reference = reference
    engine = resolve_engine_name(cfg.rollout.engine, device, quantized=cfg.model.load_in_4bit,
                                 sharded=bool(run.ds and run.ds.stage == 3) or run.fsdp)
    sampling_copy = sampling_copy_bytes(shape, engine=engine, device=device, p=p)
    if sampling_copy and not run.decoupled:
        states = replace(states, weights=states.weights + sampling_copy)
        how["weights"] += " + the hf-static engine's sampling copy (bf16 on CUDA)"
    critic = critic_memory(cfg, policy_shape=shape, gpus=run.gpus, attention=update.attention,
                           critic_config=critic_config)
    how["critic"] = critic.how if critic else "none (no critic: algorithm.advantage_estimator is not gae)"
    if run.decoupled:
        reference, how["reference"] = 0, "on the samplers / reference server (decoupled mode)"
    reference_gather = 0
    if run.fsdp and reference:  # sharded as the policy; gathered while sampling
        reference, reference_gather = reference / run.gpus, reference - reference / run.gpus
        how["reference"] += f" / {run.gpus} (FSDP2 shards; gathered while sampling)"
    vllm = vllm_hold(run, vllm_gpu_memory_utilization, gpu_gb)
    how["kv_cache"] = vllm.how
    phases, phase_notes = step_phases(run, states, update, reference=reference, critic=critic, vllm=vllm,
                                      reference_gather=reference_gather)
    notes += vllm.notes + phase_notes
    peak_phase = max(phases, key=phases.get)
    tensors = phases[peak_phase]
    overhead, how["overhead"] = cuda_overhead(allowance, run.gpus, tensors, device)
    parts = {"weights": states.weights, "gradients": states.gradients, "optimizer": states.optimizer,
             "activations": update.activations, "logits": update.logits, "reference": reference,
             "critic": critic.states if critic else 0, "kv_cache": vllm.during_update, "overhead": overhead}
    total_gb = gb(tensors + overhead)
    sampler = (sampler_bytes(run, states, reference=sampler_reference, sampling_copy=sampling_copy)
               if run.decoupled else 0)
    notes += closing_notes(run, phases, peak_phase, sampler)
    return MemoryEstimate(per_device_gb={k: gb(parts[k]) for k in COMPONENTS}, total_gb=total_gb,
                          fits=None if gpu_gb is None else total_gb <= gpu_gb, notes=notes,
                          assumptions=assumptions(run, states, update, allowance),
                          phases_gb={k: gb(v) for k, v in phases.items()}, peak_phase=peak_phase, how=how,
                          gpus=run.gpus, gpu_gb=gpu_gb, sampler_gb=gb(sampler) if run.decoupled else None)


def _check_arguments(gpus: int | None, gpu_gb: float | None, vllm_gpu_memory_utilization: float | None) -> None:
    if gpus is not None and gpus < 1:
        raise ConfigError(f"--gpus: {gpus} must be >= 1")
    if gpu_gb is not None and gpu_gb <= 0:
        raise ConfigError(f"--gpu-gb: {gpu_gb} must be > 0")
    if vllm_gpu_memory_utilization is not None and not 0 < vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm-gpu-memory-utilization: {vllm_gpu_memory_utilization} must be in (0, 1]")


def cuda_overhead(allowance: CudaAllowance, gpus: int, tensors: float, device: str) -> tuple[float, str]:
    """(bytes, how) a device holds beyond the peak phase's ``tensors``: none on a CPU."""
    if device != "cuda":
        return 0.0, "none (CPU)"
    overhead = (allowance.context_gb + (allowance.nccl_gb if gpus > 1 else 0)) * GIB \
        + allowance.fragmentation * tensors
    return overhead, (f"CUDA context {allowance.context_gb} GB" + (f" + NCCL {allowance.nccl_gb} GB" if gpus > 1
                                                                     else "")
                      + f" + {allowance.fragmentation:.0%} allocator fragmentation")


def sampler_bytes(run: RunSizing, states: ModelStates, *, reference: int, sampling_copy: int) -> int:
    """The tensors of a decoupled sampler's device: weights (and LoRA adapters), reference, the sampling copy
    and the rollout's transients."""
    return (run.shape.num_params() * run.p + (states.trained_params * LORA_BYTES if run.lora else 0) + reference
            + sampling_copy + rollout_transient_bytes(run.shape, run.cfg, rows=run.generation_rows, p=run.p))


def closing_notes(run: RunSizing, phases: dict[str, float], peak_phase: str, sampler: int) -> list[str]:
    """The notes on the whole estimate: a peak outside the update, autocast, the sampler devices of
    decoupled mode (``sampler``: their tensors' bytes), DeepSpeed's buckets."""
    notes = []
    if peak_phase != "update":
        notes.append(f"the peak is the {peak_phase.replace('_', ' ')} phase ({gb(phases[peak_phase]):.2f} GB of "
                     f"tensors), not the update ({gb(phases['update']):.2f} GB): the components above are the "
                     "update's")
    if run.autocast:
        notes.append("bf16 on grpo's torch path: fp32 master weights, gradients and AdamW states, bf16 compute "
                     "(autocast); the reference copy is bf16")
    if run.decoupled:
        notes.append(f"decoupled mode: these are the trainer ranks' devices; each sampler device needs about "
                     f"{sampler / GIB:.2f} GB of tensors (weights, reference, KV cache)")
    if run.ds and run.ds.stage in (1, 2):
        notes.append("DeepSpeed's reduce/all-gather buckets (reduce_bucket_size) are not counted")
    if run.shape.counts is not None:
        notes.append("parameters counted on this family's own model class; activations from a Llama/Qwen2 "
                     "decoder's formulas with the family's norms, query/key norms, fused projections, latent attention "
                     "and experts read off that class, and its norms' and router's saved tensors measured on a CPU "
                     "copy (within 3% of autograd on tiny models in fp32 and bf16: docs/guides/models.md)")
    return notes


def assumptions(run: RunSizing, states: ModelStates, update: UpdatePass, allowance: CudaAllowance) -> dict:
    """The numbers the estimate rests on (``MemoryEstimate.assumptions``)."""
    cfg, lora = run.cfg, run.lora
    return {
        "model": cfg.model.name_or_path, "params": run.shape.num_params(), "trained_params": states.trained_params,
        "dtype": "bf16" if run.p == 2 else "fp32",
        "mode": f"LoRA r={cfg.model.lora_r} {list(run.targets)}" if lora else "full",
        "mixed_precision_adamw": run.mixed_precision, "autocast_weight_copies_gb": gb(update.weight_copies),
        "zero_stage": run.ds.stage if run.ds else 0, "fsdp": run.fsdp, "gpus": run.gpus,
        "micro_batch_size": update.rows,
        "prompt_tokens": cfg.data.max_prompt_length, "completion_tokens": cfg.rollout.max_completion_length,
        "attention": update.attention, "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "device": run.device, "allowance": asdict(allowance) if run.device == "cuda" else None,
        "gb": "GiB (2^30 bytes)",
    }
