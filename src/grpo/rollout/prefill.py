"""The prompt pass that starts a generation call of the ``hf`` and ``hf-static`` engines.

A plain prefill runs every prompt left-padded to the longest: with a shared system prompt and prompts of
varied lengths most of that work repeats or pads. So, when it saves tokens, the prefill
- runs the tokens every prompt starts with (the chat template and system prompt) once, as one row, and
- feeds each prompt's rest in passes of prompts of similar length (sorted; a pass grows while its padding
  stays within ``PADDING_SLACK`` of its real tokens),
and lays the keys/values out as the decode loop reads them: the shared prefix, a masked gap, each rest
right-aligned (the layout a multi-turn row's cached prefix already has). Causal attention makes this exact: a
position's keys/values depend only on the tokens up to it, at the same true positions; only the float order
of the sums may differ from the padded pass. Multi-turn calls continue from their rows' cached prefixes
(``grpo.rollout.prefix_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from grpo.compat import cache_argument, returned_cache
from grpo.rollout.hf import left_pad
from grpo.rollout.prefix_cache import PrefixCache

MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth a pass of its own
PADDING_SLACK = 0.25  # a rest pass may run up to 25% more positions than its real tokens


@dataclass
class Prefill:
    """What a prefill of ``U`` prompts gives the decode loop.

    logits:        [U, V] each prompt's next-token logits.
    cache:         a ``DynamicCache`` of [U, heads, W, d] per layer.
    key_mask:      [U, W] long, 1 on the slots holding a prompt token (a cached or shared prefix and the fed
                   rest, each left-padded: a row may have a gap of padding between the two).
    last_position: [U, 1] long, each prompt's last position (its length - 1).
    prompt_ids:    [U, Lp] the whole prompts, left-padded; prompt_mask [U, Lp] (the repetition penalty's).
    """

    logits: Tensor
    cache: DynamicCache
    key_mask: Tensor
    last_position: Tensor
    prompt_ids: Tensor
    prompt_mask: Tensor


def prefill(model, encoded: list[list[int]], pad_id: int, device, prefix_cache: PrefixCache | None,
            plain: bool = False) -> Prefill:
    """One prefill of the prompts ``encoded`` (true positions): from their cached prefixes when a multi-turn
    ``prefix_cache`` holds them, else sharing their common prefix and grouping them by length where that
    saves positions, else one padded pass. ``plain``: always the one padded pass (its forward's tokens are the
    left-padded ``[U, W]`` prompts, row-major: what a routing recording lines up with)."""
    ids, mask = left_pad(encoded, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    hits = prefix_cache.take(encoded) if prefix_cache is not None and not plain else [None] * len(encoded)
    if any(hit is not None for hit in hits):
        return _from_cached_prefixes(model, encoded, hits, pad_id, device, prefix_cache, ids, mask)
    shared = common_prefix_length(encoded)
    shared = shared if shared >= MIN_SHARED_PREFIX else 0
    passes = rest_passes([len(p) - shared for p in encoded])
    if prefix_cache is None and not plain and (shared or len(passes) > 1):
        result = _shared_and_grouped(model, encoded, shared, passes, pad_id, device, ids, mask)
        if result is not None:
            return result
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    if prefix_cache is not None:
        prefix_cache.fed_tokens += ids.numel()
    return Prefill(out.logits[:, -1], returned_cache(out), mask, positions[:, -1:], ids, mask)


def common_prefix_length(encoded: list[list[int]]) -> int:
    """The tokens every prompt starts with, leaving each at least one of its own (a pass needs a token to
    give the next logits); 0 for fewer than two prompts."""
    if len(encoded) < 2:
        return 0
    limit = min(len(p) for p in encoded) - 1
    first = encoded[0]
    n = 0
    while n < limit and all(p[n] == first[n] for p in encoded):
        n += 1
    return n


def rest_passes(lengths: list[int]) -> list[list[int]]:
    """Row indices in passes: sorted by length, a pass grows while rows x its longest stays within
    ``1 + PADDING_SLACK`` of its real tokens (one pass when lengths are alike)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    passes: list[list[int]] = []
    real = 0
    for i in order:
        if passes and (len(passes[-1]) + 1) * lengths[i] <= (1 + PADDING_SLACK) * (real + lengths[i]):
            passes[-1].append(i)
            real += lengths[i]
        else:
            passes.append([i])
            real = lengths[i]
    return passes


def _shared_and_grouped(model, encoded: list[list[int]], shared: int, passes: list[list[int]], pad_id: int,
                        device, ids: Tensor, mask: Tensor) -> Prefill | None:
    """The prefix pass (when ``shared``), then one pass per group of rests; None when the model's cache is
    not plain full-attention layers (a sliding window keeps its own layout): the caller runs the padded pass."""
    U = len(encoded)
    prefix = None  # per layer (keys, values) [1, h, shared, d]
    if shared:
        head = torch.tensor([encoded[0][:shared]], device=device)  # [1, shared]
        out = model(input_ids=head, attention_mask=torch.ones_like(head), position_ids=torch.arange(
            shared, device=device)[None], use_cache=True, logits_to_keep=1)
        if not _plain_layers(returned_cache(out)):
            return None
        prefix = [(layer.keys, layer.values) for layer in returned_cache(out).layers]
    rests = [p[shared:] for p in encoded]
    width = max(len(r) for r in rests)  # S: the rests right-aligned in S slots after the prefix
    keys = values = logits = None
    key_mask = torch.zeros(U, shared + width, dtype=torch.long, device=device)  # [U, shared + S]
    key_mask[:, :shared] = 1
    for rows in passes:
        rest_ids, rest_mask = left_pad([rests[i] for i in rows], pad_id)
        rest_ids, rest_mask = rest_ids.to(device), rest_mask.to(device)  # [u, s]
        u, s = rest_ids.shape
        past = None
        if prefix is not None:
            past = DynamicCache(ddp_cache_data=[(k.expand(u, -1, -1, -1), v.expand(u, -1, -1, -1))
                                                for k, v in prefix])
        out = model(input_ids=rest_ids, attention_mask=torch.cat([rest_mask.new_ones(u, shared), rest_mask], 1),
                    position_ids=(rest_mask.cumsum(-1) - 1).clamp(min=0) + shared, **cache_argument(past),
                    use_cache=True, logits_to_keep=1)
        if not _plain_layers(returned_cache(out)):
            return None
        at = torch.tensor(rows, device=device)
        if keys is None:  # the first pass tells the layers' shapes and dtypes
            keys = [layer.keys.new_zeros(U, layer.keys.shape[1], shared + width, layer.keys.shape[-1])
                    for layer in returned_cache(out).layers]
            values = [layer.values.new_zeros(U, layer.values.shape[1], shared + width, layer.values.shape[-1])
                      for layer in returned_cache(out).layers]
            logits = out.logits.new_empty(U, out.logits.shape[-1])
        for layer, k, v in zip(returned_cache(out).layers, keys, values):
            if shared:
                k[at, :, :shared], v[at, :, :shared] = layer.keys[:, :, :shared], layer.values[:, :, :shared]
            k[at, :, shared + width - s:] = layer.keys[:, :, -s:]
            v[at, :, shared + width - s:] = layer.values[:, :, -s:]
        key_mask[at, shared + width - s:] = rest_mask
        logits[at] = out.logits[:, -1]
    last = torch.tensor([len(p) - 1 for p in encoded], device=device)[:, None]  # [U, 1]
    return Prefill(logits, DynamicCache(ddp_cache_data=list(zip(keys, values))), key_mask, last, ids, mask)


def _plain_layers(cache) -> bool:
    return cache is not None and all(type(layer) is DynamicLayer for layer in cache.layers)


def _from_cached_prefixes(model, encoded: list[list[int]], hits: list, pad_id: int, device,
                          prefix_cache: PrefixCache, ids: Tensor, mask: Tensor) -> Prefill:
    """Each prompt's cached prefix (a multi-turn row's previous turns) right-aligned in C slots, then one pass
    over the rests."""
    cached = torch.tensor([len(hit.ids) if hit is not None else 0 for hit in hits], device=device)  # [U]
    C = int(cached.max())
    rest_ids, rest_mask = left_pad([prompt[len(hit.ids) if hit is not None else 0:]
                                    for prompt, hit in zip(encoded, hits)], pad_id)
    rest_ids, rest_mask = rest_ids.to(device), rest_mask.to(device)  # [U, S]
    # The cached prefixes right-aligned in C slots (a row without one: C masked zeros)
    past_mask = (torch.arange(C, device=device) >= C - cached[:, None]).long()  # [U, C]
    template = next(hit for hit in hits if hit is not None)
    past = []
    for layer in range(len(template.keys)):
        k0, v0 = template.keys[layer], template.values[layer]
        keys = k0.new_zeros(len(hits), k0.shape[0], C, k0.shape[-1])  # [U, h, C, d]
        values = v0.new_zeros(len(hits), v0.shape[0], C, v0.shape[-1])
        for u, hit in enumerate(hits):
            if hit is not None:
                keys[u, :, C - len(hit.ids):] = hit.keys[layer]
                values[u, :, C - len(hit.ids):] = hit.values[layer]
        past.append((keys, values))
    key_mask = torch.cat([past_mask, rest_mask], dim=1)  # [U, C + S]
    positions = (rest_mask.cumsum(-1) - 1).clamp(min=0) + cached[:, None]  # [U, S] true positions
    out = model(input_ids=rest_ids, attention_mask=key_mask, position_ids=positions,
                **cache_argument(DynamicCache(ddp_cache_data=past)), use_cache=True, logits_to_keep=1)
    prefix_cache.fed_tokens += rest_ids.numel()
    prefix_cache.reused_tokens += int(cached.sum())
    return Prefill(out.logits[:, -1], returned_cache(out), key_mask, positions[:, -1:], ids, mask)
