"""Which rows of a rollout batch share a micro-batch: whole groups ordered by length (less padding, the prompt
pass still shared) and cut by rows or by a budget of padded tokens. Used by the policy and critic updates."""

from __future__ import annotations

import torch


def rows_by_length(completion_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] row order for micro-batching: whole groups, the group whose longest completion is shortest
    first. Micro-batches of similar lengths carry less padding (``completion_logprobs`` skips columns
    that pad a whole micro-batch), and groups stay together so their prompt pass is still shared."""
    longest = completion_mask.sum(-1).view(-1, group_size).amax(-1)  # [P]
    groups = torch.argsort(longest, stable=True)  # [P]
    return (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).flatten()


def token_budget_micro_batches(order: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                               max_rows: int, max_tokens: int | str | None) -> list[torch.Tensor]:
    """``order`` [N] cut into micro-batches (row-index tensors, in order): ``max_rows`` rows each, or with
    ``max_tokens`` as many rows as keep rows x (longest prompt + longest completion among them), the padded
    width a log-prob pass runs, within ``max_tokens`` (and at most ``max_rows``); a row over the budget on its
    own forms a micro-batch alone. ``max_tokens="auto"``: the budget is the padded width of the largest
    ``max_rows``-row micro-batch, with no row limit: never more tokens in a pass than fixed rows would run,
    and fewer passes where short rows fill the room. ``order`` should be ``rows_by_length``'s, so that
    neighbours are alike."""
    if max_tokens is None or order.shape[0] == 0:
        return [order[start:start + max_rows] for start in range(0, order.shape[0], max_rows)]
    prompt_lengths = prompt_mask.sum(-1)[order].tolist()  # [N], real tokens (left padding is dropped per pass)
    completion_lengths = completion_mask.sum(-1)[order].tolist()  # [N]
    if max_tokens == "auto":
        max_tokens = max(len(p) * (max(p) + max(c)) for p, c in (
            (prompt_lengths[s:s + max_rows], completion_lengths[s:s + max_rows])
            for s in range(0, len(prompt_lengths), max_rows)))
        max_rows = len(prompt_lengths)
    cuts, start, widest_prompt, widest_completion = [], 0, 0, 0
    for i, (lp, lc) in enumerate(zip(prompt_lengths, completion_lengths)):
        wp, wc = max(widest_prompt, lp), max(widest_completion, lc)
        rows = i - start + 1
        if rows > 1 and (rows > max_rows or rows * (wp + wc) > max_tokens):
            cuts.append(i)
            start, wp, wc = i, lp, lc
        widest_prompt, widest_completion = wp, wc
    bounds = [0, *cuts, order.shape[0]]
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
