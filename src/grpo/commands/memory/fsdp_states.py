"""Model states per rank under FSDP2 (``train.fsdp``, ``grpo.parallel.fsdp``): what each rank holds of the policy,
its gradients and AdamW states, and what it gathers when.

- Held all the time, 1/N each: the parameters in their stored dtype (fp32 master weights for full fine-tuning,
  also under ``model.bf16``; LoRA's frozen base in the compute dtype, its adapters in fp32), the gradients of the
  trained ones (kept sharded between micro-batches) and AdamW's m and v (fp32). There is no separate master copy:
  the fp32 shards are the master weights.
- Gathered during the update (in the compute dtype, 2 B under bf16): the root unit (embeddings, final norm, an
  untied LM head), which FSDP2 keeps from the forward to the end of the backward, one decoder layer at a time
  (two on CUDA, where the next layer is prefetched), and the root's unsharded gradient during the backward
  (the embedding's, for full fine-tuning). ``fsdp.accumulate_unsharded``: every layer and its gradient stay
  gathered from the first micro-batch to the last. ``fsdp.reshard_after_forward: false``: every layer stays
  gathered from its forward to its backward.
- Gathered while sampling (colocated): every unit, for the whole rollout (``gathered``), in the compute dtype.
- ``fsdp.cpu_offload`` on CUDA: the shards live in CPU memory; the device holds only what is gathered.
"""

from __future__ import annotations

from grpo.commands.memory.formulas import LORA_BYTES
from grpo.commands.memory.shapes import ModelShape, lora_params
from grpo.commands.memory.states import ModelStates, _count


def fsdp_model_states(shape: ModelShape, *, p: int, lora_r: int, targets: tuple[str, ...] | None, gpus: int,
                      cpu_offload: bool, reshard_after_forward: bool, accumulate_unsharded: bool,
                      device: str) -> ModelStates:
    """``ModelStates`` of one rank under FSDP2; ``p``: the compute (gathered) dtype's bytes (2 under bf16)."""
    n = gpus
    n_params = shape.num_params()
    lora = targets is not None
    n_train = lora_params(shape, lora_r, targets) if lora else n_params
    stored = n_params * p + n_train * LORA_BYTES if lora else n_params * 4  # LoRA: base in p, adapters fp32
    root = shape.root_params()  # embeddings, final norm, untied head
    layers_held = 2 if device == "cuda" else 1  # FSDP2 prefetches the next layer on CUDA streams
    how = {}
    gathered = (root + layers_held * shape.layer_params()) * p
    gathered_how = f"the root unit ({_count(root)}) + {layers_held} layer(s) gathered x {p} B"
    if accumulate_unsharded or not reshard_after_forward:
        gathered = n_params * p
        gathered_how = f"every unit gathered x {p} B (" + ("fsdp.accumulate_unsharded" if accumulate_unsharded else
                                                            "fsdp.reshard_after_forward false") + ")"
    sharded_grads = n_train * (LORA_BYTES if lora else 4) / n
    unsharded_grads = (shape.embedding_params() if not lora else 0) * p  # the root's, during the backward
    grads_how = "the root's unsharded gradient during backward"
    if accumulate_unsharded:  # no sharded gradient until the last backward reduce-scatters them
        unsharded_grads = n_train * p - sharded_grads
        grads_how = "every trained parameter's unsharded gradient until the last backward (fsdp.accumulate_unsharded)"
    optimizer = n_train * 8 / n
    weights = stored / n
    kept = f"base x {p} B + adapters x 4 B" if lora else "4 B"
    how["weights"] = f"{_count(n_params)} params stored ({kept}) / {n} (FSDP2 shards) + {gathered_how}"
    how["gradients"] = (f"{_count(n_train)} trained params x {p} B: {grads_how}" if accumulate_unsharded
                        else f"{_count(n_train)} trained params x 4 B / {n} (sharded) + {grads_how}")
    how["optimizer"] = f"AdamW m + v: 8 B x {_count(n_train)} / {n} (the fp32 shards are the master weights)"
    if cpu_offload and device == "cuda":
        weights, sharded_grads, optimizer = 0, 0, 0
        how["weights"] = f"shards in CPU memory (fsdp.cpu_offload); on the device: {gathered_how}"
        how["gradients"] = f"shards in CPU memory (fsdp.cpu_offload); on the device: {grads_how}"
        how["optimizer"] = "in CPU memory (fsdp.cpu_offload): AdamW steps there"
    return ModelStates(weights + gathered, sharded_grads + unsharded_grads, optimizer, 4, n_train, how,
                       gathered=gathered, unsharded_grads=unsharded_grads, sampling_gather=n_params * p)
