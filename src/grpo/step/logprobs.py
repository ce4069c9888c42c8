"""Per-token log-probs of completion tokens under a model, in micro-batches.

The G completions of a group share one prompt, and in GRPO the prompt is usually the longer part
(a chat template, a system prompt and a question against a short answer). So each micro-batch runs
the model over every *distinct* prompt once, keeping its KV cache, and then over the completions
alone, each reading its prompt's cache rows. Under autograd the cache rows are an index into the
prompt pass, so the prompt's gradient is the sum over its completions, exactly as if the prompt had
been run G times: the same log-probs and gradients up to float re-association, for G times less
prompt compute (and prompt activation memory). That is the CPU's default; on CUDA the plain pass (every
row's prompt + completion as one sequence) is, since there the host's dispatch, not compute, bounds the
pass (``grpo.config.device_defaults.PASS_DEFAULTS``).

Gradient checkpointing: Hugging Face drops the KV cache of a checkpointing model in training mode (the backward's
recompute would append to it twice). Under grad, grpo runs the prompt pass without checkpointing and checkpoints the
completion pass itself over a read-only cache (``grpo.step.checkpointing``), or runs the plain pass. A pass without
gradients (reference and old log-probs) runs with checkpointing switched off (``checkpointing_paused``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from grpo.algorithm import (
    LogprobProcessing,
    processed_token_entropy,
    processed_token_logprobs,
    token_entropy,
    token_entropy_with_grad,
    token_logprobs,
)
from grpo.algorithm.head import head_logprobs
from grpo.algorithm.processing import prompt_presence
from grpo.compat import cache_argument, returned_cache
from grpo.step.checkpointing import (
    can_checkpoint_with_prefix,
    checkpointing_modules,
    checkpointing_paused,
    grpo_checkpointing,
    read_only,
)
from grpo.models.logits_head import head_reproduces_forward, logits_head
from grpo.models.routing_replay import Replaying
from grpo.models.wrappers import decoder, inner_model
from grpo.step.logprob_pass import pass_choices, uses_fused_head
from grpo.step.router_logits import RoutedTokens, shared_prompt_weights

Replay = tuple[Replaying, Tensor]  # an open Replaying and a forward's recorded experts [b, T, layers, k]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory without waiting (a copy from pageable
    memory makes the host wait for the GPU's queue first). The caching host allocator keeps the pinned
    block until the copy has run."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[B, T] positions that skip left padding, as ``generate`` assigns them (so log-probs of a
    left-padded prompt match what was sampled)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def shared_prompt_index(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """Rows that repeat the row above's prompt (as a group's rows do) share one prompt pass.

    Returns ``(first [U], index [N])``: the first row of each run of equal prompts, and for each row the
    run it belongs to; None when no row repeats its predecessor (nothing to share).
    """
    repeats = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)  # [N]
    repeats[1:] = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)
    if not bool(repeats.any()):
        return None
    return (~repeats).nonzero().squeeze(-1), (~repeats).long().cumsum(0) - 1


def select_cache_rows(cache, index: Tensor) -> None:
    """``cache.batch_select_indices(index)`` with ``index_select``: repeated rows' gradients then sum in a
    fixed order. Advanced indexing's backward (``index_put_`` with accumulate) adds them with parallel
    atomics on the CPU, so two identical runs could end with different last bits. A layer kind with more
    state than keys and values keeps its own method."""
    for layer in cache.layers:
        if type(layer).batch_select_indices is not DynamicLayer.batch_select_indices:
            layer.batch_select_indices(index)
        elif layer.get_seq_length() > 0:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)


@contextmanager
def _final_hidden(model) -> Iterator[list[Tensor]]:
    """Collects the final hidden states of each forward of ``model`` while open (a hook on its decoder)."""
    captured: list[Tensor] = []
    handle = decoder(model).register_forward_hook(lambda _module, _args, output: captured.append(output[0]))
    try:
        yield captured
    finally:
        handle.remove()


def can_share_prompt_cache(model: torch.nn.Module) -> bool:
    """Whether a completion pass can read its prompt's KV cache: not while a checkpointing model trains, where
    Hugging Face drops the cache (gradients or not), unless grpo can take the checkpointing over
    (``grpo.step.checkpointing``: Hugging Face decoder layers, a cache of plain layers)."""
    return not (model.training and checkpointing_modules(model)) or can_checkpoint_with_prefix(model)


def _forward(model, fused: bool, keep: int | None, routed: RoutedTokens | None = None,
             route_weights: Tensor | None = None, replay: Replay | None = None, **inputs):
    """``(scores, KV cache)``: the last ``keep`` positions' (all when None) logits [b, keep, V], or
    with ``fused`` their final hidden states [b, keep, H], the LM head skipped (``logits_to_keep`` of no
    position: transformers slices the hidden states with it before the head). ``routed``: the forward's router
    logits are added to it, its tokens weighted by ``route_weights`` [b, T]. ``replay``: fed before it runs."""
    if replay is not None:
        replay[0].feed(replay[1].flatten(0, 1))
    if not fused:
        out = model(**inputs, **({} if keep is None else {"logits_to_keep": keep}))
        scores = out.logits
    else:
        with _final_hidden(model) as captured:
            out = model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device))
        scores = captured[-1] if keep is None else captured[-1][:, -keep:]  # [b, T or keep, H]
    if routed is not None:
        routed.add(route_weights)
    return scores, returned_cache(out)


def _full_logits(model, ids: Tensor, mask: Tensor, Lc: int, fused: bool = False,
                 routed: RoutedTokens | None = None, replay: Replay | None = None) -> Tensor:
    # [b, Lc + 1, V] (fused: [b, Lc + 1, H]): positions Lp-1 .. T-1, each predicting the next token
    return _forward(model, fused, Lc + 1, routed, mask, replay, input_ids=ids, attention_mask=mask,
                    position_ids=position_ids_from_mask(mask), use_cache=False)[0]


def _shared_prompt_logits(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                          completion_mask: Tensor, first: Tensor, index: Tensor, fused: bool = False,
                          routed: RoutedTokens | None = None, replay: Replay | None = None) -> Tensor:
    """[b, Lc + 1, V] (fused: [b, Lc + 1, H]): the same as ``_full_logits`` on the concatenation, from one
    pass over the distinct prompts (keeping only their last position) and one over the completions. A model
    that checkpoints, under gradients: grpo checkpoints the completion pass (``grpo.step.checkpointing``), or
    returns None where the cache's layers are not plain ones (the caller then runs the plain pass)."""
    takeover = torch.is_grad_enabled() and model.training and bool(checkpointing_modules(model))
    prompts, prompts_mask = prompt_ids[first], prompt_mask[first]  # [U, Lp]
    with checkpointing_paused(model) if takeover else nullcontext():
        prompt_replay = None if replay is None else (replay[0], replay[1][first, :prompt_ids.shape[1]])
        prompt_scores, cache = _forward(model, fused, 1, routed, shared_prompt_weights(prompts_mask, index),
                                        prompt_replay, input_ids=prompts, attention_mask=prompts_mask,
                                        position_ids=position_ids_from_mask(prompts_mask), use_cache=True)
    if cache is None:  # a model that ignores use_cache=True: sharing would read no prompt at all
        raise RuntimeError(
            f"grpo.step.logprobs: {type(model).__name__} returned no KV cache for the shared prompt pass "
            f"(training={model.training}, gradient checkpointing on {len(checkpointing_modules(model))} modules); "
            "completion_logprobs(share_prompts=False) runs the plain pass")
    select_cache_rows(cache, index)  # [U, ...] -> [b, ...]: an index, so gradients sum per prompt
    if takeover and not read_only(cache):
        if routed is not None:
            routed.discard_last()  # the plain pass that replaces this one routes the prompts again
        return None
    Lc = completion_ids.shape[1]
    positions = prompts_mask.sum(-1)[index, None] + torch.arange(Lc, device=completion_ids.device)  # [b, Lc]
    with grpo_checkpointing(model) if takeover else nullcontext():
        completion_replay = None if replay is None else (replay[0], replay[1][:, prompt_ids.shape[1]:])
        completion_scores, _ = _forward(model, fused, None, routed, completion_mask, completion_replay,
                                        input_ids=completion_ids,
                                        attention_mask=torch.cat([prompt_mask, completion_mask], 1),
                                        position_ids=positions, **cache_argument(cache), use_cache=True)  # [b, Lc, *]
    return torch.cat([prompt_scores.index_select(0, index), completion_scores], dim=1)


def packed_layout(prompt_mask: Tensor, completion_mask: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Where a micro-batch's rows sit once packed into one sequence of their real tokens (host tensors).

    Args: ``prompt_mask`` [b, Lp] (left-padded), ``completion_mask`` [b, W] (a prefix of each row), ``width``
    = W. Returns ``(real [b, Lp + W] bool: the tokens kept, row-major = the packed order; positions [S]:
    each row's own 0 .. n-1; scored [b, W + 1]: the packed index of each row's positions Lp-1 .. Lp+W-1, as
    the padded pass scores them, clamped to the row's last token where it has no more)``."""
    real = torch.cat([prompt_mask, completion_mask], 1).bool()  # [b, Lp + W]
    positions = position_ids_from_mask(real.long())[real]  # [S]
    prompt_lengths, lengths = prompt_mask.sum(1), real.sum(1)  # [b]
    starts = lengths.cumsum(0) - lengths  # [b]
    offsets = torch.arange(width + 1)[None]  # [1, W + 1]
    scored = torch.minimum(starts[:, None] + prompt_lengths[:, None] - 1 + offsets,
                           (starts + lengths - 1)[:, None])  # [b, W + 1]
    return real, positions, scored


def _packed_scores(model, ids: Tensor, layout: tuple[Tensor, Tensor, Tensor], fused: bool,
                   routed: RoutedTokens | None = None, replay: Replay | None = None) -> Tensor:
    """[b, W + 1, V] logits (fused: [b, W + 1, H] hidden states) of the padded pass's scored positions, from
    one forward over the rows' real tokens packed into one sequence: position ids restart at each row and
    no attention mask is given, so transformers attends within each row only (its packed-sequence
    detection: block-diagonal masks for sdpa/eager, varlen for flash-attention-2). ``ids`` [b, Lp + W]
    on the model's device; ``layout``: ``packed_layout``'s, on that device."""
    real, positions, scored = layout
    packed, positions = ids[real][None], positions[None]  # [1, S]
    if replay is not None:  # the packed tokens are the real ones, row-major
        replay[0].feed(replay[1][real.to(replay[1].device)])
    if not fused:
        logits = model(input_ids=packed, position_ids=positions, logits_to_keep=scored.flatten(),
                       use_cache=False).logits  # [1, b (W + 1), V]
        scores = logits.view(*scored.shape, -1)
    else:
        with _final_hidden(model) as captured:
            model(input_ids=packed, position_ids=positions, use_cache=False,
                  logits_to_keep=torch.empty(0, dtype=torch.long, device=packed.device))
        scores = captured[-1][0].index_select(0, scored.flatten()).view(*scored.shape, -1)  # [b, W + 1, H]
    if routed is not None:
        routed.add(torch.ones_like(packed, dtype=torch.float32))  # only real tokens are packed
    return scores


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float,
    micro_batch_size: int | None = None,
    share_prompts: bool | None = None,
    column_bucket: int | None = None,
    with_entropy: bool = False,
    processing: LogprobProcessing | None = None,
    entropy_grad: bool = False,
    fused_head: bool | None = None,
    pack: bool = False,
    router_top_k: int | None = None,
    routing: Tensor | None = None,
    replaying: Replaying | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor | None, Tensor]:
    """Log-probs of each completion token given its prompt and the completion prefix.

    Args:
        prompt_ids, prompt_mask: [N, Lp] left-padded prompts.
        completion_ids, completion_mask: [N, Lc] right-padded completions.
        temperature: the sampling temperature (logits are divided by it).
        micro_batch_size: rows per forward pass; None = all at once.
        column_bucket: run widths rounded up to a multiple of this (padding columns, masked); None: the
            model's device type's default (``pass_choices``).
        share_prompts: run each micro-batch's distinct prompts once (see the module docstring);
            False runs every row's prompt + completion as one sequence (the plain reference); None: the
            model's device type's default (``pass_choices``).
        with_entropy: also return the entropy of each completion position's sampling distribution,
            read off the same logits (``token_entropy``: no gradient, no second pass, chunked).
        entropy_grad: that entropy carries its gradient (an entropy bonus in the loss: chunks recomputed in
            backward); not with ``processing``.
        processing: the sampling controls the completions were drawn with (repetition penalty,
            min_new_tokens, min_p): the log-probs (and entropy) are then those of the processed
            distribution (``grpo.algorithm.processing``). None or all off: the tempered logits as they are.
        fused_head: the log-probs (and entropy) from the final hidden states, the LM head applied a chunk
            of positions at a time (``grpo.algorithm.head``): no micro-batch's ``[b, Lc, V]`` logits ever
            exist. None: per micro-batch, when those logits would reach the device type's size
            (``uses_fused_head``).
        pack: each micro-batch's rows run as one sequence of their real tokens (``_packed_scores``): no
            padding is computed; it replaces the shared prompt pass (each row runs its own prompt).
        router_top_k: a Mixture-of-Experts model's experts per token: the forwards' router logits are read off
            its routers, and the call returns the load-balancing loss of every real token of the rows, prompts
            and completions, as one plain pass over them would route them (``grpo.step.router_logits``).
        routing, replaying: routing replay: the rows' recorded experts (``Generation.routing``) fed to a
            ``Replaying`` whose hooks the caller holds open (through the backward: checkpointing re-routes there).

    Returns:
        [N, Lc] float32 (padding positions hold finite values, 0 past a micro-batch's longest completion,
        that the loss masks out). Gradients flow when called with grad enabled. Only the completion positions' logits (and each prompt's last)
        are computed, never the prompt's [Lp, V] logits. Without grad, gradient checkpointing is paused
        for the call (see the module docstring). With ``with_entropy``: ``(logprobs, entropy)``, both
        [N, Lc] float32 (entropy 0 past a micro-batch's longest completion). With ``router_top_k``:
        ``(logprobs, entropy or None, load-balancing loss)``, the loss 0-d with its gradient.
    """
    processing = processing if processing is not None and processing.active else None  # off: the plain logits
    with nullcontext() if torch.is_grad_enabled() else checkpointing_paused(model):
        share_prompts, column_bucket = pass_choices(next(model.parameters()).device, share_prompts, column_bucket)
        share_prompts = share_prompts and can_share_prompt_cache(model) and not pack
        routed = None if router_top_k is None else RoutedTokens(model, router_top_k)
        with nullcontext() if routed is None else routed.recording():
            logprobs, entropy = _micro_batched_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                        temperature, micro_batch_size, share_prompts, column_bucket,
                                                        with_entropy or entropy_grad, processing, fused_head, pack,
                                                        entropy_grad, routed,
                                                        None if replaying is None else (replaying, routing))
    if routed is not None:
        return logprobs, entropy, routed.loss()
    return (logprobs, entropy) if with_entropy or entropy_grad else logprobs


def _micro_batched_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                            completion_mask: Tensor, temperature: float, micro_batch_size: int | None,
                            share_prompts: bool, bucket: int, with_entropy: bool,
                            processing: LogprobProcessing | None,
                            fused_head: bool | None = None, pack: bool = False,
                            entropy_grad: bool = False, routed: RoutedTokens | None = None,
                            replay: Replay | None = None) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs``' loop over micro-batches, ``share_prompts`` and ``bucket`` already chosen:
    ([N, Lc] log-probs, [N, Lc] entropy or None); every forward's router logits go to ``routed`` (None: none), its
    recorded experts (``replay``'s [N, Lp + Lc, layers, k]) to ``replay``'s ``Replaying``."""
    Lc, Lp = completion_ids.shape[1], prompt_ids.shape[1]
    step = micro_batch_size or prompt_ids.shape[0]
    device = next(model.parameters()).device
    vocab_size = _vocab_size(model)
    # Every host-side decision (which columns run, which rows share a prompt) reads CPU copies of the masks
    # and ids: on a GPU, reading a device tensor makes the host wait for every kernel queued before it.
    prompt_ids, prompt_mask = prompt_ids.cpu(), prompt_mask.cpu()
    completion_ids, completion_mask = completion_ids.cpu(), completion_mask.cpu()
    out, entropies, head = [], [], None
    for start in range(0, prompt_ids.shape[0], step):
        rows = slice(start, start + step)
        # Columns that are padding in every row of this micro-batch (left of its longest prompt, right of
        # its longest completion) are not run at all: they change no other position's value. The widths are
        # rounded up to a multiple of ``bucket``, so that kernels and attention plans built per shape (on a
        # GPU) are reused across micro-batches and steps.
        prompt_cols = prompt_mask[rows].any(0).nonzero()
        first = int(prompt_cols.min()) if prompt_cols.numel() else 0
        first = max(0, Lp - _round_up(Lp - first, bucket))
        completion_cols = completion_mask[rows].any(0).nonzero()
        width = int(completion_cols.max()) + 1 if completion_cols.numel() else 1
        width = min(Lc, _round_up(width, bucket))
        shared = shared_prompt_index(prompt_ids[rows, first:], prompt_mask[rows, first:]) if share_prompts else None
        p_ids, p_mask = _to_device(prompt_ids[rows, first:], device), _to_device(prompt_mask[rows, first:], device)
        c_ids, c_mask = _to_device(completion_ids[rows, :width], device), _to_device(completion_mask[rows, :width], device)
        fused = uses_fused_head(fused_head, c_ids.shape[0], width + 1, vocab_size, device.type,
                                torch.is_grad_enabled()) and _fusable(model, fused_head)
        mb_replay = None if replay is None else (replay[0], _to_device(torch.cat(  # [b, Lp - first + width, L, k]
            [replay[1][rows, first:Lp], replay[1][rows, Lp:Lp + width]], 1), device))
        if pack:
            layout = tuple(_to_device(t, device) for t in packed_layout(prompt_mask[rows, first:],
                                                                        completion_mask[rows, :width], width))
            scores = _packed_scores(model, torch.cat([p_ids, c_ids], 1), layout, fused, routed, mb_replay)
        elif shared is None:
            scores = _full_logits(model, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), width, fused,
                                  routed, mb_replay)
        else:
            first_rows, index = (_to_device(t, device) for t in shared)
            scores = _shared_prompt_logits(model, p_ids, p_mask, c_ids, c_mask, first_rows, index, fused, routed,
                                           mb_replay)
            if scores is None:  # a checkpointing model whose cache grpo cannot read without extending it
                scores = _full_logits(model, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), width,
                                      fused, routed, mb_replay)
        if fused:  # scores: [b, width + 1, H] hidden states; position t predicts c_ids[:, t]
            seen = prompt_presence(p_ids, p_mask, vocab_size) if processing is not None else None  # [b, V] bool
            if head is None:  # built once per call, on the first fused micro-batch
                head = logits_head(model)
            logprobs, entropy = head_logprobs(scores[:, :-1], head, c_ids, temperature,
                                              vocab_size=vocab_size, with_entropy=with_entropy, processing=processing,
                                              real=c_mask, prompt_seen=seen, entropy_grad=entropy_grad)
        else:
            logprobs, entropy = _logits_logprobs(scores, p_ids, p_mask, c_ids, c_mask, temperature, with_entropy,
                                                 processing, entropy_grad)
        out.append(torch.nn.functional.pad(logprobs, (0, Lc - width)))  # [b, Lc], zeros where all rows pad
        if with_entropy:
            entropies.append(torch.nn.functional.pad(entropy.to(torch.promote_types(entropy.dtype, torch.float32)),
                                                     (0, Lc - width)))
    return torch.cat(out), (torch.cat(entropies) if with_entropy else None)


def _fusable(model, fused_head: bool | None) -> bool:
    """Whether the fused head gives ``model``'s log-probs (``grpo.models.logits_head``): False for a forward
    that changes the logits after the head in a way ``logits_head`` does not, which ``train.fused_lm_head:
    true`` cannot be for (a ValueError naming it; null keeps the model's own logits)."""
    if head_reproduces_forward(model):
        return True
    if fused_head:
        raise ValueError(f"train.fused_lm_head is true, but {type(inner_model(model)).__name__}'s forward changes "
                         "the logits after its LM head in a way the fused head does not reproduce: its log-probs "
                         "would be wrong; set train.fused_lm_head to null or false")
    return False


def _vocab_size(model) -> int:
    """V: the LM head's output width (the input embedding's rows for a head that does not say)."""
    inner = inner_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    return getattr(head, "out_features", None) or inner.get_input_embeddings().num_embeddings


def _logits_logprobs(logits: Tensor, p_ids: Tensor, p_mask: Tensor, c_ids: Tensor, c_mask: Tensor,
                     temperature: float, with_entropy: bool, processing: LogprobProcessing | None,
                     entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """One micro-batch's ([b, width] log-probs, entropy or None) from its [b, width + 1, V] logits."""
    if processing is None:
        targets = torch.cat([p_ids[:, -1:], c_ids], dim=1)  # [b, width + 1]: last prompt token, then the completion
        logprobs = token_logprobs(logits, targets, temperature)  # [b, width]
        entropy = (token_entropy_with_grad(logits, temperature) if entropy_grad  # while the logits exist
                   else token_entropy(logits, temperature) if with_entropy else None)
        return logprobs, entropy
    if entropy_grad:
        raise ValueError("an entropy with gradient is of the plain tempered logits: not with the sampling controls")
    # the processors read the prompt's tokens and the completion's before each position
    seen = prompt_presence(p_ids, p_mask, logits.shape[-1])  # [b, V] bool
    processed = (logits[:, :-1], c_ids, c_mask, seen, temperature, processing)  # position t predicts c_ids[:, t]
    logprobs = processed_token_logprobs(*processed).float()  # [b, width]
    return logprobs, (processed_token_entropy(*processed) if with_entropy else None)
