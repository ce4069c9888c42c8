"""Peak memory per device of a run's config: model states, activations, logits, reference, KV cache.

A step has three phases whose transients never overlap (four with PPO's critic, ``grpo.commands.memory.critic``; one
more with the PTX loss, ``ptx_update_bytes``): the rollout (sampling with a KV cache, then
no-grad reference/old log-probs), the update (forward and backward of each micro-batch, gradients
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

from grpo.config import ConfigError, RunConfig
from grpo.config.rules import ptx_max_length
from grpo.config.device_defaults import pass_defaults, resolve_engine_name
from grpo.config.kinds import engine_traits
from grpo.commands.memory.critic import critic_memory
from grpo.commands.memory.formulas import (
    LORA_BYTES,
    activation_bytes,
    autocast_extra_bytes,
    forward_transient_bytes,
    kv_cache_bytes,
    fused_head,
    fused_logits_bytes,
    logits_bytes,
    prompts_per_micro_batch,
    sampling_bytes,
    sampling_copy_bytes,
    sdpa_mask_keys,
    shared_prompt_activation_bytes,
)
from grpo.commands.memory.shapes import ModelShape, load_model_config, lora_targets
from grpo.commands.memory.states import DeepSpeedSettings, ModelStates, _count, model_states, read_deepspeed  # noqa: F401

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "reference", "critic", "kv_cache",
              "overhead")


def _gb(n: float) -> float:
    return round(n / GIB, 3)


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

    def to_json(self) -> dict:
        """The ``grpo memory --json`` object."""
        return {"per_device_gb": self.per_device_gb, "total_gb": self.total_gb, "fits": self.fits,
                "gpus": self.gpus, "gpu_gb": self.gpu_gb, "peak_phase": self.peak_phase,
                "phases_gb": self.phases_gb, "notes": self.notes, "assumptions": self.assumptions}


def reference_bytes(cfg: RunConfig, *, n_params: int, p: int, ref_model_config: dict | None) -> tuple[int, str]:
    """(bytes, how) of the reference model wherever the KL term needs one: none when beta is 0 or for
    LoRA without ``ref_name_or_path`` (the adapter disabled), else the initial policy or the named
    model, in ``ref_torch_dtype`` (default: the policy's dtype)."""
    if cfg.loss.beta == 0:
        return 0, "none (loss.beta = 0)"
    if cfg.model.ref_name_or_path is None and cfg.model.lora_r > 0:
        return 0, "none: the LoRA policy with its adapter disabled"
    ref_bytes = DTYPE_BYTES[cfg.model.ref_torch_dtype] if cfg.model.ref_torch_dtype else p
    ref_params = n_params
    if cfg.model.ref_name_or_path is not None:
        if ref_model_config is None:
            ref_model_config, _ = load_model_config(cfg.model.ref_name_or_path, "model.ref_name_or_path")
        ref_params = ModelShape.from_config(ref_model_config, cfg.model.ref_name_or_path).num_params()
    return ref_params * ref_bytes, f"{_count(ref_params)} params x {ref_bytes} B"


def rollout_transient_bytes(shape: ModelShape, cfg: RunConfig, *, rows: int, p: int) -> int:
    """The rollout's largest transient: sampling ``rows`` completions with the HF engines (KV cache of
    prompt + completion, sampling temporaries, the prefill's layer) or a no-grad log-prob micro-batch
    (its logits in ``p``, one fp32 row in logsumexp, one layer's intermediates)."""
    prompt_len, completion_len = cfg.data.max_prompt_length, cfg.rollout.max_completion_length
    generation = 0
    if not engine_traits(cfg.rollout.engine).own_weights:  # vLLM samples inside its own reservation
        prompts = max(1, rows // cfg.rollout.num_generations)
        generation = (kv_cache_bytes(shape, sequences=rows, seq_len=prompt_len + completion_len, p=p)
                      + sampling_bytes(rows=rows, vocab_size=shape.vocab_size)
                      + forward_transient_bytes(shape, tokens=prompts * prompt_len, p=p))
    logprobs = 0
    if cfg.loss.beta > 0 or cfg.loss.num_iterations > 1:  # reference or old log-probs
        b, positions = cfg.train.micro_batch_size, completion_len + 1
        logprobs = ((p * b + 2 * 4) * positions * shape.vocab_size
                    + forward_transient_bytes(shape, tokens=b * (prompt_len + completion_len), p=p))
    return max(generation, logprobs)


def ptx_update_bytes(shape: ModelShape, cfg: RunConfig, *, p: int, lora_targets: tuple[str, ...] | None,
                     attention: str, autocast: bool, device: str = "cuda") -> tuple[int, str]:
    """(bytes, how) of the PTX micro-batch's forward and backward (``ptx.data``), which runs after the policy's
    micro-batches, their activations freed, beside the accumulated gradients: ``ptx.micro_batch_size`` whole
    sequences of the PTX max length (distinct prompts: no shared prompt pass), logits at every position (an
    upper bound: only the response's are computed)."""
    b, seq_len = cfg.ptx.micro_batch_size, ptx_max_length(cfg)
    checkpointing = cfg.model.gradient_checkpointing
    logits, _ = update_logits_bytes(cfg, micro_batch=b, positions=seq_len, vocab_size=shape.vocab_size, p=p,
                                    device=device)
    activations = activation_bytes(shape, micro_batch=b, seq_len=seq_len, p=p, lora_targets=lora_targets,
                                   lora_r=cfg.model.lora_r, attention=attention,
                                   gradient_checkpointing=checkpointing, logits=logits)
    if autocast:  # fp32 residual/norm tensors (autocast's weight copies are counted with the weights already)
        activations += autocast_extra_bytes(shape, tokens=b * seq_len, gradient_checkpointing=checkpointing)[1]
    return activations + logits, f"PTX micro-batch: {b} x {seq_len} tokens, activations + logits"


def update_logits_bytes(cfg: RunConfig, *, micro_batch: int, positions: int, vocab_size: int,
                        p: int, device: str = "cuda") -> tuple[int, str]:
    """(bytes, how) of one training micro-batch's log-prob work: the whole logits and their gradient, or
    the fused head's chunk (``train.fused_lm_head``; null: by the logits' size on ``device``, as the passes
    decide)."""
    shape = dict(micro_batch=micro_batch, positions=positions, vocab_size=vocab_size)
    if fused_head(cfg.train.fused_lm_head, **shape, device_type=device):
        return (fused_logits_bytes(**shape),
                f"fused LM head: one chunk of {micro_batch} x {positions} x {vocab_size} logits at a time, recomputed "
                "in backward (train.fused_lm_head)")
    return (logits_bytes(**shape, p=p),
            f"(4 + {p}) B x {micro_batch} x {positions} x {vocab_size}: fp32 log-softmax rows + grad")


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
    if gpus is not None and gpus < 1:
        raise ConfigError(f"--gpus: {gpus} must be >= 1")
    if gpu_gb is not None and gpu_gb <= 0:
        raise ConfigError(f"--gpu-gb: {gpu_gb} must be > 0")
    if vllm_gpu_memory_utilization is not None and not 0 < vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm-gpu-memory-utilization: {vllm_gpu_memory_utilization} must be in (0, 1]")
    source = "the given config"
    if model_config is None:
        model_config, source = load_model_config(cfg.model.name_or_path, "model.name_or_path")
    shape = ModelShape.from_config(model_config, cfg.model.name_or_path)
    notes = [f"model shape from {source}"]
    decoupled = cfg.train.mode == "decoupled"
    gpus = gpus or (cfg.decoupled.trainer_ranks if decoupled else 1)
    ds = read_deepspeed(cfg.train.deepspeed) if cfg.train.deepspeed else None
    p = 2 if cfg.model.bf16 else 4
    lora = cfg.model.lora_r > 0
    targets = lora_targets(cfg.model.lora_target_modules) if lora else None
    # grpo's torch path trains bf16 full fine-tuning on fp32 master weights under bf16 autocast: the
    # weights, gradients and AdamW states are fp32 (16 B/param), the activations mostly bf16. (A forced
    # mixed_precision estimates the seeds' DeepSpeed-style bf16 weights + fp32 master copy instead.)
    autocast = (mixed_precision is None and cfg.model.bf16 and not lora and ds is None
                and not cfg.model.load_in_4bit)
    if mixed_precision is None:
        mixed_precision = ds is not None and p != 4
    states = model_states(shape, p=4 if autocast else p, lora_r=cfg.model.lora_r, targets=targets, mixed_precision=mixed_precision,
                          gpus=gpus, deepspeed=ds, base_4bit=cfg.model.load_in_4bit,
                          optimizer_8bit=cfg.optim.optimizer == "adamw_8bit")
    how = dict(states.how)

    # The update: one micro-batch's activations and logits at the peak of its backward.
    b, completion_len = cfg.train.micro_batch_size, cfg.rollout.max_completion_length
    seq_len = cfg.data.max_prompt_length + completion_len
    budget = cfg.train.max_tokens_per_micro_batch
    # "auto" never holds more tokens than the fixed rows' largest micro-batch: sized as micro_batch_size rows
    if isinstance(budget, int):  # full-length rows within the budget: its largest micro-batch (one row at least)
        b = max(1, min(b, budget // seq_len))
        notes.append(f"train.max_tokens_per_micro_batch {budget}: micro-batches of at most {b} full-length rows")
    attention = cfg.model.attn_implementation or "sdpa"
    if attention not in ("sdpa", "eager", "flash_attention_2"):
        notes.append(f"attention {attention!r} is sized as sdpa")
        attention = "sdpa"
    logits, how["logits"] = update_logits_bytes(cfg, micro_batch=b, positions=completion_len + 1,
                                                vocab_size=shape.vocab_size, p=p, device=device)
    # grpo.step.logprobs runs each distinct prompt of a micro-batch once (not under gradient checkpointing)
    prompts, prompt_len = prompts_per_micro_batch(b, cfg.rollout.num_generations), cfg.data.max_prompt_length
    share = cfg.train.shared_prompt_pass  # null: the device type's default
    share = pass_defaults(device).share_prompts if share is None else share
    shared = (prompts < b and not cfg.model.gradient_checkpointing and share
              and not cfg.train.pack_sequences)  # packed rows each run their own prompt
    if shared:
        activations = shared_prompt_activation_bytes(
            shape, micro_batch=b, prompts=prompts, prompt_len=prompt_len, completion_len=completion_len, p=p,
            lora_targets=targets, lora_r=cfg.model.lora_r, attention=attention, logits=logits,
            pending_gradients=states.trained_params * (4 if autocast else p))
        how["activations"] = (f"{prompts} prompts x {prompt_len} + {b} completions x {completion_len} tokens "
                              f"(each prompt run once), {shape.num_layers} layers, every layer's saved tensors")
    else:
        activations = activation_bytes(shape, micro_batch=b, seq_len=seq_len, p=p, lora_targets=targets,
                                       lora_r=cfg.model.lora_r, attention=attention,
                                       gradient_checkpointing=cfg.model.gradient_checkpointing, logits=logits,
                                       mask_keys=sdpa_mask_keys(micro_batch=b, seq_len=seq_len,
                                                                packed=cfg.train.pack_sequences))
        how["activations"] = f"{b} x {seq_len} tokens, {shape.num_layers} layers, " + (
            "checkpointed: layer inputs + final norm or one layer recomputed" if cfg.model.gradient_checkpointing
            else "every layer's saved tensors")
    weight_copies = 0
    if autocast:
        tokens = prompts * prompt_len + b * completion_len if shared else b * seq_len
        weight_copies, wider = autocast_extra_bytes(shape, tokens=tokens,
                                                    gradient_checkpointing=cfg.model.gradient_checkpointing)
        states = replace(states, weights=states.weights + weight_copies)
        how["weights"] = states.how["weights"] + " + autocast's bf16 copies of the layer linears (2 B each)"
        activations += wider
        how["activations"] += " + fp32 residual/norm tensors (autocast)"

    reference, how["reference"] = reference_bytes(cfg, n_params=shape.num_params(), p=p,
                                                  ref_model_config=ref_model_config)
    sampler_reference = reference
    engine = resolve_engine_name(cfg.rollout.engine, device, quantized=cfg.model.load_in_4bit,
                                 sharded=bool(ds and ds.stage == 3))
    sampling_copy = sampling_copy_bytes(shape, engine=engine, device=device, p=p)
    if sampling_copy and not decoupled:
        states = replace(states, weights=states.weights + sampling_copy)
        how["weights"] += " + the hf-static engine's sampling copy (bf16 on CUDA)"
    critic = critic_memory(cfg, policy_shape=shape, gpus=gpus, attention=attention, critic_config=critic_config)
    how["critic"] = critic.how if critic else "none (no critic: algorithm.advantage_estimator is not gae)"
    if decoupled:
        reference, how["reference"] = 0, "on the samplers / reference server (decoupled mode)"

    # A colocated vLLM reserves utilization x GPU memory (its weights, activations and KV cache), held
    # through every phase unless it sleeps during the update (sleep mode frees it, CUDA only).
    sequences = max(1, cfg.train.prompts_per_step // gpus) * cfg.rollout.num_generations
    vllm_reservation = 0.0
    how["kv_cache"] = "none held during the update (the HF engine's cache lives only while sampling)"
    if engine_traits(cfg.rollout.engine).own_weights and not decoupled:
        utilization = vllm_gpu_memory_utilization or cfg.rollout.vllm_gpu_memory_utilization
        if gpu_gb:
            vllm_reservation = utilization * gpu_gb * GIB
            how["kv_cache"] = f"vLLM reservation: {utilization} x {gpu_gb} GB"
        else:
            vllm_reservation = shape.num_params() * 2 + kv_cache_bytes(shape, sequences=sequences, seq_len=seq_len,
                                                                       p=2)
            how["kv_cache"] = f"vLLM: bf16 weights + KV of {sequences} x {seq_len} tokens (a lower bound)"
            notes.append("vLLM sized from its weights and the step's sequences; pass --gpu-gb (and "
                         "--vllm-gpu-memory-utilization) for the reservation it actually takes")
    vllm_sleeps = cfg.rollout.vllm_enable_sleep_mode
    kv_cache = 0.0 if vllm_sleeps else vllm_reservation
    if vllm_reservation and vllm_sleeps:
        how["kv_cache"] = f"none: vLLM sleeps during the update ({_gb(vllm_reservation):.2f} GB while sampling)"

    # Phases: their transients never overlap, so the peak is the largest.
    persistent = states.weights + states.optimizer + reference + kv_cache + (critic.states if critic else 0)
    phases = {"update": persistent + states.gradients + activations + logits}
    if critic:  # PPO: the critic's update follows the policy's, whose gradients torch has freed
        phases["critic_update"] = persistent + critic.gradients + critic.activations
    if cfg.ptx.data:
        ptx, ptx_how = ptx_update_bytes(shape, cfg, p=p, lora_targets=targets, attention=attention, autocast=autocast,
                                        device=device)
        phases["ptx_update"] = persistent + states.gradients + ptx
        notes.append(f"{ptx_how}: {_gb(ptx):.2f} GB in its own phase, after the policy's micro-batches")
    # grpo's torch AdamW is per tensor on the CPU (a sqrt(v) of the largest tensor at a time) and fused on
    # CUDA (grpo.parallel.optim.build_optimizer: in place, no temporaries; the foreach one it replaced took a
    # sqrt(v) of every tensor at once, which was the H200 check's optimizer-step peak). DeepSpeed's Adam,
    # bitsandbytes' 8-bit AdamW and the fused AdamW a forced --mixed-precision run is taken to use need none.
    step_temporaries = 0
    if ds is None and not mixed_precision and device != "cuda" and cfg.optim.optimizer != "adamw_8bit":
        largest_tensor = (max(shape.embedding_params(), shape.intermediate_size * shape.hidden_size) if not lora
                          else max(cfg.model.lora_r * max(shape.linear_shapes()[t]) for t in targets))
        step_temporaries = largest_tensor * states.state_bytes
    phases["optimizer_step"] = persistent + states.gradients + step_temporaries
    generation_rows = min(cfg.rollout.generation_batch_size or sequences, sequences)
    if not decoupled:
        kept_gradients = states.gradients if ds else 0  # torch frees gradients after each update
        awake = vllm_reservation if vllm_sleeps else 0  # a sleeping vLLM wakes up to sample
        phases["rollout"] = (persistent + kept_gradients + awake
                             + rollout_transient_bytes(shape, cfg, rows=generation_rows, p=p))
        if not engine_traits(cfg.rollout.engine).own_weights:
            kv = kv_cache_bytes(shape, sequences=generation_rows, seq_len=seq_len, p=p)
            notes.append(f"HF generation KV cache: {generation_rows} x {seq_len} tokens = {kv / GIB:.2f} GB while "
                         "sampling (in the rollout phase)")
    peak_phase = max(phases, key=phases.get)
    tensors = phases[peak_phase]

    overhead = 0.0
    how["overhead"] = "none (CPU)"
    if device == "cuda":
        overhead = (allowance.context_gb + (allowance.nccl_gb if gpus > 1 else 0)) * GIB \
            + allowance.fragmentation * tensors
        how["overhead"] = (f"CUDA context {allowance.context_gb} GB" + (f" + NCCL {allowance.nccl_gb} GB" if gpus > 1
                                                                        else "")
                           + f" + {allowance.fragmentation:.0%} allocator fragmentation")
    parts = {"weights": states.weights, "gradients": states.gradients, "optimizer": states.optimizer,
             "activations": activations, "logits": logits, "reference": reference,
             "critic": critic.states if critic else 0, "kv_cache": kv_cache,
             "overhead": overhead}
    total_gb = _gb(tensors + overhead)

    if peak_phase != "update":
        notes.append(f"the peak is the {peak_phase.replace('_', ' ')} phase ({_gb(tensors):.2f} GB of tensors), "
                     f"not the update ({_gb(phases['update']):.2f} GB): the components above are the update's")
    if autocast:
        notes.append("bf16 on grpo's torch path: fp32 master weights, gradients and AdamW states, bf16 compute "
                     "(autocast); the reference copy is bf16")
    if decoupled:
        sampler = (shape.num_params() * p + (states.trained_params * LORA_BYTES if lora else 0) + sampler_reference
                   + sampling_copy
                   + rollout_transient_bytes(shape, cfg, rows=generation_rows, p=p))
        notes.append(f"decoupled mode: these are the trainer ranks' devices; each sampler device needs about "
                     f"{sampler / GIB:.2f} GB of tensors (weights, reference, KV cache)")
    if ds and ds.stage in (1, 2):
        notes.append("DeepSpeed's reduce/all-gather buckets (reduce_bucket_size) are not counted")
    assumptions = {
        "model": cfg.model.name_or_path, "params": shape.num_params(), "trained_params": states.trained_params,
        "dtype": "bf16" if p == 2 else "fp32", "mode": f"LoRA r={cfg.model.lora_r} {list(targets)}" if lora else "full",
        "mixed_precision_adamw": mixed_precision, "autocast_weight_copies_gb": _gb(weight_copies), "zero_stage": ds.stage if ds else 0, "gpus": gpus,
        "micro_batch_size": b, "prompt_tokens": cfg.data.max_prompt_length, "completion_tokens": completion_len,
        "attention": attention, "gradient_checkpointing": cfg.model.gradient_checkpointing, "device": device,
        "allowance": asdict(allowance) if device == "cuda" else None, "gb": "GiB (2^30 bytes)",
    }
    return MemoryEstimate(per_device_gb={k: _gb(parts[k]) for k in COMPONENTS}, total_gb=total_gb,
                          fits=None if gpu_gb is None else total_gb <= gpu_gb, notes=notes, assumptions=assumptions,
                          phases_gb={k: _gb(v) for k, v in phases.items()}, peak_phase=peak_phase, how=how,
                          gpus=gpus, gpu_gb=gpu_gb)
