"""How a run holds its model (``RunSizing``) and the bytes of each phase of a step: the update's micro-batch,
the reference, a colocated vLLM, the rollout's transients, the PTX micro-batch and the optimizer step
(``grpo.commands.memory.estimate`` adds them up into the peak)."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo.commands.memory.critic import CriticMemory
from grpo.commands.memory.formulas import (
    activation_bytes,
    autocast_extra_bytes,
    forward_transient_bytes,
    fused_head,
    fused_logits_bytes,
    kv_cache_bytes,
    logits_bytes,
    prompts_per_micro_batch,
    sampling_bytes,
    sdpa_mask_keys,
    shared_prompt_activation_bytes,
)
from grpo.commands.memory.shapes import ModelShape, load_model_config, lora_targets
from grpo.commands.memory.states import DeepSpeedSettings, ModelStates, _count, read_deepspeed
from grpo.config import RunConfig
from grpo.config.device_defaults import pass_defaults
from grpo.config.kinds import engine_traits
from grpo.config.rules import ptx_max_length, updates_per_step

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gb(n: float) -> float:
    return round(n / GIB, 3)


@dataclass(frozen=True)
class RunSizing:
    """How the run holds its model, as every part of the estimate reads it.

    gpus: the devices the run is spread over; ds: its DeepSpeed settings (None: torch);
    p: bytes of a weight or activation element (2: bf16, 4: fp32); targets: LoRA's adapted linears (None:
    full fine-tuning); autocast: grpo's torch path trains bf16 full fine-tuning on fp32 master weights under
    bf16 autocast: the weights, gradients and AdamW states are fp32 (16 B/param), the activations mostly bf16
    (a forced mixed_precision estimates the seeds' DeepSpeed-style bf16 weights + fp32 master copy instead);
    mixed_precision: AdamW with fp32 master weights and m, v; device: "cuda" or "cpu"; fsdp: ``train.fsdp`` (the
    policy and reference sharded over ``gpus``: ``grpo.commands.memory.fsdp_states``).
    """

    cfg: RunConfig
    shape: ModelShape
    gpus: int
    ds: DeepSpeedSettings | None
    p: int
    targets: tuple[str, ...] | None
    autocast: bool
    mixed_precision: bool
    device: str
    fsdp: bool = False

    @property
    def lora(self) -> bool:
        return self.cfg.model.lora_r > 0

    @property
    def decoupled(self) -> bool:
        return self.cfg.train.mode == "decoupled"

    @property
    def seq_len(self) -> int:
        return self.cfg.data.max_prompt_length + self.cfg.rollout.max_completion_length

    @property
    def sequences(self) -> int:
        """The step's completions on one device."""
        return max(1, self.cfg.train.prompts_per_step // self.gpus) * self.cfg.rollout.num_generations

    @property
    def generation_rows(self) -> int:
        """The completions sampled at once."""
        return min(self.cfg.rollout.generation_batch_size or self.sequences, self.sequences)


def run_sizing(cfg: RunConfig, *, gpus: int | None, model_config: dict | None, mixed_precision: bool | None,
               device: str) -> tuple[RunSizing, str]:
    """(``cfg``'s ``RunSizing``, where the model's shape came from); arguments as ``estimate_memory``'s."""
    source = "the given config"
    if model_config is None:
        model_config, source = load_model_config(cfg.model.name_or_path, "model.name_or_path")
    shape = ModelShape.from_config(model_config, cfg.model.name_or_path)
    gpus = gpus or (cfg.decoupled.trainer_ranks if cfg.train.mode == "decoupled" else 1)
    ds = read_deepspeed(cfg.train.deepspeed) if cfg.train.deepspeed else None
    p = 2 if cfg.model.bf16 else 4
    lora = cfg.model.lora_r > 0
    autocast = (mixed_precision is None and cfg.model.bf16 and not lora and ds is None
                and not cfg.model.load_in_4bit and not cfg.train.fsdp)  # FSDP2 gathers bf16 units instead
    if mixed_precision is None:
        mixed_precision = ds is not None and p != 4
    targets = lora_targets(cfg.model.lora_target_modules, shape) if lora else None
    return RunSizing(cfg, shape, gpus, ds, p, targets, autocast, mixed_precision, device,
                     cfg.train.fsdp), source


@dataclass
class UpdatePass:
    """One training micro-batch at the peak of its backward.

    rows: its rows (``train.micro_batch_size``, fewer within a token budget); attention: the implementation
    sized; logits, activations: bytes; weight_copies: autocast's bf16 copies of the layer linears (0 without
    autocast); how: the "logits" and "activations" lines; notes: what the sizing changed.
    """

    rows: int
    attention: str
    logits: int
    activations: int
    weight_copies: int = 0
    how: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def update_pass(run: RunSizing, trained_params: int) -> UpdatePass:
    """The update's micro-batch: its activations and logits at the peak of its backward; ``trained_params``:
    the parameters whose gradients are pending."""
    cfg, shape, p = run.cfg, run.shape, run.p
    b, completion_len, seq_len = cfg.train.micro_batch_size, cfg.rollout.max_completion_length, run.seq_len
    notes, how = [], {}
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
                                                vocab_size=shape.vocab_size, p=p, device=run.device)
    # grpo.step.logprobs runs each distinct prompt of a micro-batch once (not under gradient checkpointing)
    prompts, prompt_len = prompts_per_micro_batch(b, cfg.rollout.num_generations), cfg.data.max_prompt_length
    share = cfg.train.shared_prompt_pass  # null: the device type's default
    share = pass_defaults(run.device).share_prompts if share is None else share
    shared = (prompts < b and not cfg.model.gradient_checkpointing and share
              and not cfg.train.pack_sequences)  # packed rows each run their own prompt
    if shared:
        activations = shared_prompt_activation_bytes(
            shape, micro_batch=b, prompts=prompts, prompt_len=prompt_len, completion_len=completion_len, p=p,
            lora_targets=run.targets, lora_r=cfg.model.lora_r, attention=attention, logits=logits,
            pending_gradients=trained_params * (4 if run.autocast else p))
        how["activations"] = (f"{prompts} prompts x {prompt_len} + {b} completions x {completion_len} tokens "
                              f"(each prompt run once), {shape.num_layers} layers, every layer's saved tensors")
    else:
        activations = activation_bytes(shape, micro_batch=b, seq_len=seq_len, p=p, lora_targets=run.targets,
                                       lora_r=cfg.model.lora_r, attention=attention,
                                       gradient_checkpointing=cfg.model.gradient_checkpointing, logits=logits,
                                       mask_keys=sdpa_mask_keys(micro_batch=b, seq_len=seq_len,
                                                                packed=cfg.train.pack_sequences))
        how["activations"] = f"{b} x {seq_len} tokens, {shape.num_layers} layers, " + (
            "checkpointed: layer inputs + final norm or one layer recomputed" if cfg.model.gradient_checkpointing
            else "every layer's saved tensors")
    update = UpdatePass(b, attention, logits, activations, how=how, notes=notes)
    if run.autocast:
        tokens = prompts * prompt_len + b * completion_len if shared else b * seq_len
        update.weight_copies, wider = autocast_extra_bytes(shape, tokens=tokens,
                                                           gradient_checkpointing=cfg.model.gradient_checkpointing)
        update.activations += wider
        how["activations"] += " + fp32 residual/norm tensors (autocast)"
    return update


@dataclass
class VllmHold:
    """A colocated vLLM's memory: ``reservation`` (utilization x GPU memory: its weights, activations and KV
    cache) and what of it the update phase holds (``during_update``: 0 when it sleeps, CUDA only); ``how``:
    the "kv_cache" line."""

    reservation: float
    during_update: float
    sleeps: bool
    how: str
    notes: list[str] = field(default_factory=list)


def vllm_hold(run: RunSizing, utilization: float | None, gpu_gb: float | None) -> VllmHold:
    """``VllmHold`` of the run (nothing unless a colocated vLLM samples); ``utilization``: the share of
    ``gpu_gb`` it reserves (None: ``rollout.vllm_gpu_memory_utilization``)."""
    cfg, notes = run.cfg, []
    reservation = 0.0
    how = "none held during the update (the HF engine's cache lives only while sampling)"
    if engine_traits(cfg.rollout.engine).own_weights and not run.decoupled:
        utilization = utilization or cfg.rollout.vllm_gpu_memory_utilization
        if gpu_gb:
            reservation = utilization * gpu_gb * GIB
            how = f"vLLM reservation: {utilization} x {gpu_gb} GB"
        else:
            sequences, seq_len = run.sequences, run.seq_len
            reservation = run.shape.num_params() * 2 + kv_cache_bytes(run.shape, sequences=sequences,
                                                                      seq_len=seq_len, p=2)
            how = f"vLLM: bf16 weights + KV of {sequences} x {seq_len} tokens (a lower bound)"
            notes.append("vLLM sized from its weights and the step's sequences; pass --gpu-gb (and "
                         "--vllm-gpu-memory-utilization) for the reservation it actually takes")
    sleeps = cfg.rollout.vllm_enable_sleep_mode
    if reservation and sleeps:
        how = f"none: vLLM sleeps during the update ({gb(reservation):.2f} GB while sampling)"
    return VllmHold(reservation, 0.0 if sleeps else reservation, sleeps, how, notes)


def step_phases(run: RunSizing, states: ModelStates, update: UpdatePass, *, reference: int,
                critic: CriticMemory | None, vllm: VllmHold,
                reference_gather: float = 0) -> tuple[dict[str, float], list[str]]:
    """({phase: its tensors' bytes}, notes): the phases of a step, whose transients never overlap, so the
    peak is the largest. FSDP2: the units gathered in the update (``states.gathered``, ``unsharded_grads``) are
    freed for the optimizer step; sampling gathers every unit instead (``sampling_gather``, and the rest of the
    reference: ``reference_gather``)."""
    cfg, notes = run.cfg, []
    persistent = states.weights + states.optimizer + reference + vllm.during_update + (critic.states if critic else 0)
    phases = {"update": persistent + states.gradients + update.activations + update.logits}
    if critic:  # PPO: the critic's update follows the policy's, whose gradients torch has freed
        phases["critic_update"] = persistent + critic.gradients + critic.activations
    if cfg.ptx.data:
        ptx, ptx_how = ptx_update_bytes(run.shape, cfg, p=run.p, lora_targets=run.targets, attention=update.attention,
                                        autocast=run.autocast, device=run.device)
        phases["ptx_update"] = persistent + states.gradients + ptx
        notes.append(f"{ptx_how}: {gb(ptx):.2f} GB in its own phase, after the policy's micro-batches")
    phases["optimizer_step"] = (persistent - states.gathered + states.gradients - states.unsharded_grads
                                + optimizer_step_temporaries(run, states))
    if not run.decoupled:
        kept_gradients = states.gradients if run.ds else 0  # torch frees gradients after each update
        awake = vllm.reservation if vllm.sleeps else 0  # a sleeping vLLM wakes up to sample
        rows = run.generation_rows
        phases["rollout"] = (persistent - states.gathered + states.sampling_gather + reference_gather + kept_gradients
                             + awake + rollout_transient_bytes(run.shape, cfg, rows=rows, p=run.p))
        if not engine_traits(cfg.rollout.engine).own_weights:
            kv = kv_cache_bytes(run.shape, sequences=rows, seq_len=run.seq_len, p=run.p)
            notes.append(f"HF generation KV cache: {rows} x {run.seq_len} tokens = {kv / GIB:.2f} GB while "
                         "sampling (in the rollout phase)")
    return phases, notes


def optimizer_step_temporaries(run: RunSizing, states: ModelStates) -> int:
    """The optimizer step's temporaries. grpo's torch AdamW is per tensor on the CPU (a sqrt(v) of the largest
    tensor at a time) and fused on CUDA (``grpo.parallel.optim.build_optimizer``: in place, no temporaries).
    DeepSpeed's Adam, bitsandbytes' 8-bit AdamW and the fused AdamW a forced --mixed-precision run is taken to
    use need none."""
    cfg, shape = run.cfg, run.shape
    if run.ds is not None or run.mixed_precision or run.device == "cuda" or cfg.optim.optimizer == "adamw_8bit":
        return 0
    largest_tensor = (shape.largest_tensor_params() if not run.lora
                      else cfg.model.lora_r * shape.longest_linear_side(run.targets))
    return largest_tensor * states.state_bytes // (run.gpus if run.fsdp else 1)  # FSDP2: a shard's


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
    if cfg.loss.beta > 0 or updates_per_step(cfg) > 1:  # reference or old log-probs
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
