"""Bytes of each part of a GRPO step's memory: pure functions of sizes, no config objects.

Activations are counted as the tensors autograd saves for backward in the Hugging Face Llama/Qwen2
decoder (``modeling_qwen2.py``, transformers 5.2x), tensor by tensor, per token, with ``p`` the
bytes of the compute dtype (2 for bf16, 4 for fp32); ``h`` hidden size, ``i`` MLP width, ``qd`` =
heads x head_dim, ``kvd`` = kv_heads x head_dim, ``s`` the sequence length. Per decoder layer:

- each RMSNorm (two): its input upcast to fp32 (4h, kept by ``pow`` and the rsqrt product), the
  normalised value in ``p`` (ph, only when the norm weight trains), and its output (ph) when a
  following linear keeps it;
- attention: q, k and v after RoPE, k/v repeated to all heads (``repeat_kv``: a padding mask
  keeps SDPA off its GQA path), and the attention output: 4 x p x qd; SDPA also keeps the padding
  mask converted to the compute dtype, p x s per token (an s^2 term per sequence). Without a mask
  (``sdpa_mask_keys``: one unpadded row) SDPA takes GQA and causality in its kernel: q, out, and k, v
  at kv width, nothing [s, s];
- MLP: gate output, its SiLU, up output (3 x p x i) and, when down_proj keeps it, their product (pi).

In all, full fine-tuning keeps (8 + 4p)h + 4p x qd + 4p x i + p x s bytes per token per layer (padded
rows, sdpa): for bf16 and qd = h, 24h + 8i + 2s (Qwen2.5-3B: 137 kB, about 67h); for fp32, 40h + 16i + 4s.
With gradient checkpointing a layer keeps only its input, p x h per token, and one layer is recomputed in
backward. Korthikanti et al. (2022) count 34sbh + 5as^2b for a GPT block with dropout; this block has no
dropout, a gated MLP of width i and RMSNorm, hence the itemised count. LoRA changes what is kept: a
frozen linear keeps no input; each adapted linear keeps its input for ``lora_A`` (cast to fp32 when
the base is bf16, since peft keeps adapters in fp32: one 4-byte copy per adapted linear) and
lora_A's r-wide output. These counts were checked against ``torch.autograd.graph.saved_tensors_hooks``
on tiny Qwen2 models (fp32/bf16, full/LoRA, all-linear and [q_proj, v_proj]); see tests/test_memory.py.
"""

from __future__ import annotations

import math

from grpo.commands.memory.shapes import ModelShape
from grpo.config.device_defaults import fused_head_by_size
from grpo.config.kinds import engine_traits

LORA_BYTES = 4  # peft's get_peft_model(autocast_adapter_dtype=True) keeps bf16/fp16 adapters in fp32
# The linears that read a layer's normed hidden state, by the names families give them (fused: Phi-3, GLM-4;
# latent: DeepSeek-V3): a LoRA adapter on one keeps that input.
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa")
MLP_INPUTS = ("gate_proj", "up_proj", "gate_up_proj")


def sdpa_mask_keys(*, micro_batch: int, seq_len: int, packed: bool = False) -> int:
    """Keys per query position of the additive mask each sdpa layer keeps for backward (transformers 5.x).

    One row is never padded (``grpo.step.logprobs`` drops the columns that are padding in every row of a
    micro-batch), so transformers builds no mask and passes ``is_causal`` (``_ignore_causal_mask_sdpa``):
    0, and SDPA's flash-style kernel never makes an [s, s] tensor (measured on the CPU; CUDA's flash kernel
    is built not to). Several rows: taken as padded, each row's own [s, s] mask: ``seq_len``. Packed rows
    (``train.pack_sequences``): one block-diagonal mask over the whole packed sequence: ``micro_batch x
    seq_len`` (measured: [1, 1, S, S] saved per layer).
    """
    if micro_batch == 1:
        return 0
    return micro_batch * seq_len if packed else seq_len


def layer_activation_bytes(shape: ModelShape, *, tokens: int, seq_len: int, p: int,
                           lora_targets: tuple[str, ...] | None, lora_r: int, attention: str,
                           input_requires_grad: bool = True, mask_keys: int | None = None) -> int:
    """Bytes one decoder layer keeps for backward over ``tokens`` = micro-batch x ``seq_len`` positions.

    ``lora_targets`` None = full fine-tuning (every weight trains). ``attention``: sdpa, eager or
    flash_attention_2. ``input_requires_grad`` False for the first layer of a LoRA model without
    gradient checkpointing (frozen embeddings: its first norm keeps nothing for the input's sake).
    ``mask_keys``: the sdpa mask's keys per query (``sdpa_mask_keys``); None: ``seq_len`` (padded rows).
    """
    h, i = shape.hidden_size, shape.intermediate_size
    qd, kvd = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    full = lora_targets is None
    cast = (not full) and p != LORA_BYTES  # peft casts each adapted linear's input to the adapter dtype

    def kept_input(width: int, consumers: tuple[str, ...]) -> int:
        # The input of these linears, kept once when shared in its own dtype, once per adapter when cast.
        if full:
            return p * width
        hits = [c for c in consumers if c in lora_targets]
        if not hits:
            return 0
        return LORA_BYTES * width * len(hits) if cast else p * width

    per_token = 0
    t = shape.traits
    norm = t.kept_per_element("norm", p, full)  # one RMSNorm over the hidden width, per element (Llama: 4 + p)
    per_token += (norm if input_requires_grad else (p if full else 0)) * h  # input_layernorm
    per_token += kept_input(h, ATTENTION_INPUTS)
    # q, k, v need no gradient when nothing before them trains (first layer over frozen embeddings).
    attention_trains = input_requires_grad or any(t in lora_targets for t in ATTENTION_INPUTS)
    mask_keys = seq_len if mask_keys is None else mask_keys
    # transformers hands GQA to SDPA only without a mask and for head_dim <= 256 (``use_gqa_in_sdpa``)
    sdpa_gqa = attention == "sdpa" and mask_keys == 0 and shape.head_dim <= 256
    if attention_trains:
        if t.latent_attention is not None:
            per_token += latent_attention_bytes(t.latent_attention, shape.num_heads, p)
        elif attention == "flash_attention_2" or sdpa_gqa:
            per_token += p * (2 * qd + 2 * kvd)  # q, out at full width; k, v at kv width (no repeat)
        else:
            per_token += 4 * p * qd  # q, repeated k, repeated v, output (o_proj's input is the same storage)
        if attention == "sdpa":
            per_token += p * mask_keys  # the mask as an additive bias in the compute dtype (0: none)
        elif attention == "eager":
            per_token += (4 + (p if p != 4 else 0)) * shape.num_heads * seq_len  # fp32 softmax + probs in p
    elif "o_proj" in lora_targets and not cast:
        per_token += p * qd  # only o_proj's adapter keeps the attention output
    if cast and "o_proj" in lora_targets:
        per_token += LORA_BYTES * qd
    per_token += norm * h + kept_input(h, MLP_INPUTS)  # post-attn norm
    per_token += (t.hidden_norms - 2) * norm * h  # post-norms (Gemma 3, GLM-4)
    if attention_trains and t.qk_norm:  # the q and k norms' input and normalised value
        per_token += t.kept_per_element("qk_norm", p, full) * (qd + kvd)
    if attention_trains and t.fused_qkv:  # v is a view of the fused output: attention keeps all of it
        per_token += p * (qd + kvd)
    if t.attention_output_copied and (full or "o_proj" in lora_targets):  # o_proj's own copy of its input
        per_token += p * qd

    def gated(width: int) -> int:  # gate, act(gate), up; their product when down_proj keeps it
        return 3 * p * width + kept_input(width, ("down_proj",))

    if t.moe_layers:
        # each routed copy of a token: its gathered input and expert output (h each) and gate_up, act, product
        # (4 x expert width) when the experts train, else gate_up, act and output; the router's own (an fp32 copy of
        # its input in some families, its probabilities)
        k, width = t.experts_per_token, t.expert_width
        routed = k * p * ((2 * h + 4 * width) if full else (h + 3 * width)) + t.router_bytes(p, full, h)
        moe = routed + (gated(t.shared_width) if t.shared_width else 0)
        dense = gated(t.dense_width or i)
        per_token += (t.moe_layers * moe + (shape.num_layers - t.moe_layers) * dense) // shape.num_layers
    else:
        per_token += gated(i)
    if not full:
        per_token += LORA_BYTES * lora_r * len(lora_targets)  # lora_A outputs, kept by lora_B
    return per_token * tokens


def latent_attention_bytes(ranks: tuple[int, int, int, int, int], heads: int, p: int) -> int:
    """Bytes per token one multi-head latent attention (DeepSeek-V3's MLA) keeps when it trains, ``ranks`` = (q
    LoRA rank or 0, kv LoRA rank, q/k no-rope and rope head dims, v head dim): the latents' norms (fp32 input, their
    normalised value and output, which q_b/kv_b keep; the kv norm's input is a view of kv_a's whole output), kv_b's
    output (v is a view of it), q and k concatenated from their parts, the output and o_proj's copy of it."""
    q_rank, kv_rank, nope, rope, v = ranks
    latents = (4 + 2 * p) * q_rank + 4 * (kv_rank + rope) + 2 * p * kv_rank
    return latents + p * heads * (nope + v) + 2 * p * heads * (nope + rope) + 2 * p * heads * v


def final_norm_bytes(shape: ModelShape, *, tokens: int, p: int, full: bool) -> int:
    """The final RMSNorm: fp32 input (4h), and in full fine-tuning its normalised value and its output
    (the LM head keeps a slice of it, which holds the whole tensor)."""
    h = shape.hidden_size
    return tokens * (4 * h + (2 * p * h if full else 0))


def mlp_backward_bytes(shape: ModelShape, *, tokens: int, p: int, cast_down_adapter: bool = False) -> int:
    """Backward temporaries of one layer at their largest: in the backward of gate x up, the gradient of
    the product and of both factors (3 x p x i per token) are alive while the layer's saved tensors
    still are; a down_proj adapter on a bf16 base adds the fp32 gradient of its cast input and its
    cast back (4 + p per i)."""
    return (3 * p + (4 + p if cast_down_adapter else 0)) * shape.intermediate_size * tokens


def _backward_temporaries(shape: ModelShape, *, tokens: int, p: int, lora_targets: tuple[str, ...] | None) -> int:
    """``mlp_backward_bytes``, with the cast a down_proj adapter on a non-fp32 base adds."""
    cast_down = lora_targets is not None and p != LORA_BYTES and "down_proj" in lora_targets
    return mlp_backward_bytes(shape, tokens=tokens, p=p, cast_down_adapter=cast_down)


def activation_bytes(shape: ModelShape, *, micro_batch: int, seq_len: int, p: int,
                     lora_targets: tuple[str, ...] | None, lora_r: int, attention: str,
                     gradient_checkpointing: bool, logits: int = 0, mask_keys: int | None = None) -> int:
    """Activation memory at the peak of one micro-batch's backward, beside ``logits`` (see ``logits_bytes``).

    Backward starts with the logits' gradient (every saved tensor still alive), then frees the final
    norm's tensors and walks the layers, the last one adding its MLP temporaries
    (``mlp_backward_bytes``); the peak is the larger of the two moments, and what it holds beyond the
    logits is returned:
    - without checkpointing: every layer's saved tensors + the final norm's, or + the MLP temporaries
      minus the final norm's tensors (freed by then) when that is larger than the logits;
    - with (non-reentrant) checkpointing: each layer's input (p x h per token) + the boolean mask,
      then either the final norm's tensors (beside the logits) or one layer recomputed in full with
      its MLP temporaries (after the logits are freed).
    ``mask_keys``: as ``layer_activation_bytes`` (sdpa only; None: ``seq_len``, padded rows).
    """
    tokens = micro_batch * seq_len
    full = lora_targets is None
    layer = {"shape": shape, "tokens": tokens, "seq_len": seq_len, "p": p, "lora_targets": lora_targets,
             "lora_r": lora_r, "attention": attention, "mask_keys": mask_keys}
    bool_mask_keys = mask_keys if attention == "sdpa" and mask_keys is not None else seq_len
    final = final_norm_bytes(shape, tokens=tokens, p=p, full=full)
    temporaries = _backward_temporaries(shape, tokens=tokens, p=p, lora_targets=lora_targets)
    if gradient_checkpointing:
        checkpoints = shape.num_layers * p * shape.hidden_size * tokens + tokens * bool_mask_keys
        return checkpoints + max(final, layer_activation_bytes(**layer) + temporaries - logits)
    # LoRA without checkpointing: frozen embeddings, so the first layer's input needs no gradient.
    first = layer_activation_bytes(**layer, input_requires_grad=full)
    saved = first + (shape.num_layers - 1) * layer_activation_bytes(**layer)
    return saved + final + max(0, temporaries - final - logits)


def prompts_per_micro_batch(micro_batch: int, group_size: int) -> int:
    """The most distinct prompts a micro-batch can hold: the prompt passes ``grpo.step.logprobs`` runs. Rows
    come in groups of ``group_size`` and micro-batches start at multiples of ``micro_batch``, so a
    micro-batch starts at an offset into a group that is a multiple of gcd(micro_batch, group_size),
    at most ``group_size - gcd``."""
    latest_start = group_size - math.gcd(micro_batch, group_size)
    return min(micro_batch, (latest_start + micro_batch - 1) // group_size + 1)


def shared_prompt_activation_bytes(shape: ModelShape, *, micro_batch: int, prompts: int, prompt_len: int,
                                   completion_len: int, p: int, lora_targets: tuple[str, ...] | None, lora_r: int,
                                   attention: str, logits: int = 0, pending_gradients: int = 0) -> int:
    """``activation_bytes`` for ``grpo.step.logprobs``' shared-prompt passes (no gradient checkpointing).

    Each layer keeps its tensors for the prompt pass (``prompts`` x ``prompt_len`` tokens) and the
    completion pass (``micro_batch`` x ``completion_len`` query tokens over ``prompt_len +
    completion_len`` keys), plus, in the completion pass, every row's own copy of the prompt positions'
    repeated K and V that attention keeps (2 x p x qd per prompt position per row; kv width under flash
    attention). Backward runs the completion pass first, so a second moment can be the peak: when it
    ends, every weight used by both passes holds its completion-pass gradient in autograd's buffer until
    the prompt pass adds its part (``pending_gradients``: one copy of the trained parameters' gradients,
    which the caller knows; the embedding's dense gradient comes on top), while the prompt pass's
    tensors are all still saved. The larger moment, beyond ``logits``, is returned.
    """
    full = lora_targets is None
    common = {"shape": shape, "p": p, "lora_targets": lora_targets, "lora_r": lora_r, "attention": attention}
    prompt_tokens, completion_tokens = prompts * prompt_len, micro_batch * completion_len
    width = (shape.num_kv_heads if attention == "flash_attention_2" else shape.num_heads) * shape.head_dim

    def prompt_pass(input_requires_grad: bool) -> int:  # one prompt alone is unpadded: no mask
        return layer_activation_bytes(tokens=prompt_tokens, seq_len=prompt_len, input_requires_grad=input_requires_grad,
                                      mask_keys=sdpa_mask_keys(micro_batch=prompts, seq_len=prompt_len), **common)

    def completion_pass(input_requires_grad: bool) -> int:  # a mask always: the queries start past the prompt
        attention_trains = input_requires_grad or any(t in lora_targets for t in ATTENTION_INPUTS)
        return (layer_activation_bytes(tokens=completion_tokens, seq_len=prompt_len + completion_len,
                                       input_requires_grad=input_requires_grad, **common)
                + (2 * p * width * micro_batch * prompt_len if attention_trains else 0))

    def all_layers(per_layer) -> int:  # LoRA: frozen embeddings, so layer one's input needs no gradient
        return per_layer(full) + (shape.num_layers - 1) * per_layer(True)

    prompt_saved = all_layers(prompt_pass) + final_norm_bytes(shape, tokens=prompt_tokens, p=p, full=full)
    final = final_norm_bytes(shape, tokens=prompt_tokens + completion_tokens, p=p, full=full)
    saved = all_layers(prompt_pass) + all_layers(completion_pass) + final
    temporaries = _backward_temporaries(shape, tokens=max(prompt_tokens, completion_tokens), p=p,
                                        lora_targets=lora_targets)
    at_start = saved + max(0, temporaries - final - logits)
    embedding_gradient = shape.vocab_size * shape.hidden_size * p if full else 0
    between_passes = prompt_saved + pending_gradients + embedding_gradient - logits  # the logits are freed
    return max(at_start, between_passes)


def logits_bytes(*, micro_batch: int, positions: int, vocab_size: int, p: int) -> int:
    """Peak of the logits and log-softmax of one training micro-batch (``positions`` = completion + 1).

    grpo.algorithm.token_logprobs works one sequence at a time, but under autograd each row's fp32
    logits (the upcast copy, or the fp32 logits themselves) stay saved for logsumexp's backward:
    4 bytes x b x positions x V. Backward then builds the logits' gradient row by row in ``p`` while
    those rows are still held: (4 + p) x b x positions x V at its peak (the stack of the row gradients
    and the slice's backward are 2p, never more). Plus one row's logsumexp/backward temporaries: two
    [positions, V] fp32 tensors (measured at Qwen's vocabulary on the CPU, fp32: 16.0 B per logit with one
    row, 9.1 with eight; benchmarks/length_sweep.py and logprob_memory.py).
    """
    full = micro_batch * positions * vocab_size
    return (4 + p) * full + 2 * 4 * positions * vocab_size


# grpo.algorithm.head.CHUNK_ELEMENTS, repeated here so the planner imports no torch (tests/test_fused_head.py
# checks they agree)
HEAD_CHUNK_ELEMENTS = 2 ** 25


def fused_head(setting: bool | None, *, micro_batch: int, positions: int, vocab_size: int,
               device_type: str = "cuda") -> bool:
    """Whether ``train.fused_lm_head`` (``setting``) fuses a training micro-batch of this shape on a
    ``device_type`` device (as the passes decide: ``grpo.step.logprobs.uses_fused_head``)."""
    return fused_head_by_size(setting, rows=micro_batch, positions=positions, vocab_size=vocab_size,
                              device_type=device_type, grad=True)


def fused_logits_bytes(*, micro_batch: int, positions: int, vocab_size: int) -> int:
    """Peak of the fused head's log-prob work in one training micro-batch (``grpo.algorithm.head``): one
    chunk of ``micro_batch`` x c positions x V at a time, c = HEAD_CHUNK_ELEMENTS // (micro_batch V).

    The peak is in backward's recompute of a chunk, at ``LogsumexpBackward`` (torch's
    ``logsumexp_backward``: ``grad * (self - result).exp()``), which holds four float32 [b, c, V] tensors:
    the float32 scores logsumexp saved, ``self - result``, its ``exp`` and their product with the
    gradient; 16 B per element whatever the compute dtype (the head's own p-byte output is freed once
    upcast; gather's gradient comes after). Measured with the profiler on Qwen's vocabulary, CPU, fp32:
    4.0 chunks with one row and with eight (benchmarks/length_sweep.py, logprob_memory.py).
    """
    columns = min(positions, max(1, HEAD_CHUNK_ELEMENTS // max(micro_batch * vocab_size, 1)))
    return 4 * 4 * micro_batch * columns * vocab_size  # four float32 chunk tensors (the docstring)


def forward_transient_bytes(shape: ModelShape, *, tokens: int, p: int) -> int:
    """A no-grad forward's largest live intermediates: one layer's MLP (gate, up, their product) and
    attention tensors; nothing is kept across layers."""
    return tokens * p * (3 * shape.intermediate_size + 4 * shape.num_heads * shape.head_dim)


def kv_cache_bytes(shape: ModelShape, *, sequences: int, seq_len: int, p: int) -> int:
    """K and V of every layer: 2 x layers x kv_heads x head_dim x p per token, for ``sequences`` x ``seq_len``."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * p * sequences * seq_len


def sampling_bytes(*, rows: int, vocab_size: int) -> int:
    """Per-token sampling temporaries of the lean HF loop: last logits, fp32 scaled copy, softmax and
    the top-p sort: about four [rows, V] fp32 tensors."""
    return 4 * 4 * rows * vocab_size


def autocast_extra_bytes(shape: ModelShape, *, tokens: int, gradient_checkpointing: bool) -> tuple[int, int]:
    """What bf16 autocast over fp32 weights holds beyond pure bf16 training's activations: the bf16 copy
    autocast caches of every layer linear's weight (2 B/param, kept until the optimizer step), and the
    residual stream and RMSNorm tensors, which stay fp32 (about 7 [tokens, h] tensors per layer 2 B
    wider; calibrated on an H200: Qwen2.5-0.5B body, 4 x 608 tokens, measured +1378 MiB, this 1381).
    With checkpointing only the layer inputs (fp32 instead of bf16) and one recomputed layer remain.
    Returns (weight copies, extra activation bytes)."""
    linear = shape.linear_params()
    per_layer = 14 * tokens * shape.hidden_size
    wider = (2 * tokens * shape.hidden_size * shape.num_layers + per_layer) if gradient_checkpointing \
        else per_layer * shape.num_layers
    return linear * 2, wider


def sampling_copy_bytes(shape: ModelShape, *, engine: str, device: str, p: int) -> int:
    """An engine with a sampling copy (``EngineTraits.sampling_copy``: ``hf-static``, ``auto`` on CUDA) holds it
    for the whole run: bf16 on CUDA, the policy's dtype (``p`` bytes) elsewhere. Other engines: 0 (vLLM's is in
    its reservation). ``engine`` is the resolved name (``grpo.rollout.build.resolve_engine_name``)."""
    if not engine_traits(engine).sampling_copy:
        return 0
    return shape.num_params() * (2 if device == "cuda" else p)
