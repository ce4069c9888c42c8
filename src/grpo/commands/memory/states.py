"""Model states per device: the weights, gradients and AdamW states of a trained model, and the
DeepSpeed ZeRO settings that divide them over GPUs (bytes per parameter: see ``grpo.commands.memory.estimate``)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.commands.memory.formulas import LORA_BYTES
from grpo.commands.memory.shapes import ModelShape, lora_params
from grpo.config.deepspeed_json import read_deepspeed_json


@dataclass(frozen=True)
class DeepSpeedSettings:
    stage: int
    offload_optimizer: bool
    offload_params: bool


def read_deepspeed(path: str | dict) -> DeepSpeedSettings:
    """ZeRO stage and offloading of a DeepSpeed config (``train.deepspeed``: a JSON file relative to the working dir,
    or the mapping)."""
    zero = read_deepspeed_json(path).get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return str((zero.get(key) or {}).get("device", "none")).lower() in ("cpu", "nvme")

    stage = int(zero.get("stage", 0))
    return DeepSpeedSettings(stage, offloaded("offload_optimizer"), stage == 3 and offloaded("offload_param"))


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@dataclass(frozen=True)
class ModelStates:
    """Bytes per device of the policy's weights, gradients and AdamW states, and how each was counted."""

    weights: float
    gradients: float
    optimizer: float
    state_bytes: int  # bytes of one AdamW moment per trained parameter
    trained_params: int
    how: dict[str, str]
    # FSDP2 (grpo.commands.memory.fsdp_states): what of weights / gradients the update holds beyond the optimizer
    # step (gathered units, unsharded gradients), and what sampling gathers instead (every unit)
    gathered: float = 0.0
    unsharded_grads: float = 0.0
    sampling_gather: float = 0.0


def model_states(shape: ModelShape, *, p: int, lora_r: int, targets: tuple[str, ...] | None, mixed_precision: bool,
                 gpus: int, deepspeed: DeepSpeedSettings | None, base_4bit: bool = False,
                 optimizer_8bit: bool = False) -> ModelStates:
    """Weights (the base in ``p`` bytes, LoRA adapters in fp32), gradients of the trained parameters,
    AdamW m and v (fp32 under mixed precision or for fp32 parameters, else in the parameters' dtype)
    plus an fp32 master copy under mixed precision; ZeRO stage s divides the first s of optimizer,
    gradients, weights over ``gpus``; plain DDP (several GPUs, no DeepSpeed) adds its gradient buckets."""
    n_params = shape.num_params()
    lora = targets is not None
    n_train = lora_params(shape, lora_r, targets) if lora else n_params
    train_bytes = LORA_BYTES if lora else p
    stage = deepspeed.stage if deepspeed else 0
    how = {}
    weights = n_params * p + (n_train * LORA_BYTES if lora else 0)
    how["weights"] = f"{_count(n_params)} params x {p} B" + (f" + {_count(n_train)} LoRA params x 4 B" if lora else "")
    if base_4bit:
        # QLoRA: bitsandbytes packs the layers' linear weights in 4 bits (+ one fp32 absmax per 64, itself
        # 8-bit with double quantisation: ~0.127 bit); embeddings, norms and the LM head stay in p bytes.
        linear = shape.linear_params()
        weights = linear * (4.127 / 8) + (n_params - linear) * p + n_train * LORA_BYTES
        how["weights"] = (f"{_count(linear)} linear params x 0.52 B (NF4) + {_count(n_params - linear)} x {p} B + "
                          f"{_count(n_train)} LoRA params x 4 B")
    if stage == 3 and gpus > 1:
        weights = weights / gpus + shape.largest_module_params() * p
        how["weights"] += f" / {gpus} (ZeRO-3) + the largest module gathered"
    if deepspeed and deepspeed.offload_params:
        weights = shape.largest_module_params() * p
        how["weights"] = "offloaded to CPU (ZeRO-3 offload_param); the largest module gathered"
    gradients = n_train * train_bytes
    how["gradients"] = f"{_count(n_train)} trained params x {train_bytes} B"
    if deepspeed is None and gpus > 1:
        gradients *= 2
        how["gradients"] += " x 2 (DDP's gradient buckets are a second copy)"
    if stage >= 2:
        gradients /= gpus
        how["gradients"] += f" / {gpus} (ZeRO-{stage})"
    master = mixed_precision and train_bytes != 4
    state_bytes = 4 if (mixed_precision or train_bytes == 4) else train_bytes
    if optimizer_8bit:  # bitsandbytes AdamW8bit: m and v blockwise 8-bit (+ an fp32 scale per 2048, ignored)
        state_bytes = 1
    per_param = (4 if master else 0) + 2 * state_bytes
    optimizer = n_train * per_param
    how["optimizer"] = (f"AdamW{' 8-bit' if optimizer_8bit else ''} {'fp32 master + ' if master else ''}m + v: "
                        f"{per_param} B x {_count(n_train)}")
    if stage >= 1:
        optimizer /= gpus
        how["optimizer"] += f" / {gpus} (ZeRO-{stage})"
    if deepspeed and deepspeed.offload_optimizer:
        optimizer = 0
        how["optimizer"] = "offloaded to CPU (offload_optimizer)"
    return ModelStates(weights, gradients, optimizer, state_bytes, n_train, how)
