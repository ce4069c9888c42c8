"""Plain-Python references (loops over floats) for grpo.algorithm, shared by its tests."""

from __future__ import annotations

import math

import torch


def ref_group_advantages(rewards: list[float], G: int, scale: str, eps: float) -> list[float]:
    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):  # Bessel's correction; a single value has no spread
        if len(xs) < 2:
            return 0.0
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    groups = [rewards[i : i + G] for i in range(0, len(rewards), G)]
    batch_std = std(rewards)
    out = []
    for g in groups:
        m = mean(g)
        for r in g:
            centred = 0.0 if all(x == g[0] for x in g) else r - m
            if scale == "group":
                out.append(centred / (std(g) + eps))
            elif scale == "batch":
                out.append(centred / (batch_std + eps))
            else:
                out.append(centred)
    return out


def ref_token_logprobs(logits, ids, temperature):
    B, T, V = len(logits), len(logits[0]), len(logits[0][0])
    out = []
    for b in range(B):
        row = []
        for t in range(T - 1):
            z = [logits[b][t][v] / temperature for v in range(V)]
            m = max(z)
            lse = m + math.log(sum(math.exp(x - m) for x in z))
            row.append(z[ids[b][t + 1]] - lse)
        out.append(row)
    return out


def ref_policy_loss(logp, old, ref, adv, mask, eps_low, eps_high, beta, loss_type, max_len, level="token",
                    kl_times_ratio=False):
    N, L = len(logp), len(logp[0])
    per_tok = [[0.0] * L for _ in range(N)]
    kls, clipped_count, ratios = [], 0, []
    for i in range(N):
        n_real = sum(1 for t in range(L) if mask[i][t])
        # GSPO: the row's ratio is exp of the mean over its real tokens of logp - old
        seq_log_ratio = sum(logp[i][t] - old[i][t] for t in range(L) if mask[i][t]) / max(n_real, 1)
        for t in range(L):
            ratio = math.exp(logp[i][t] - old[i][t] if level == "token" else seq_log_ratio)
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]  # per token (GAE) or per completion
            unclipped = ratio * a
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high) * a
            obj = min(unclipped, clipped)
            kl = 0.0
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                kl = math.exp(d) - d - 1
                if kl_times_ratio:  # TRL's use_bias_correction_kl
                    kl *= ratio
            per_tok[i][t] = -(obj - beta * kl)
            if mask[i][t]:
                kls.append(kl)
                ratios.append(ratio)
                clipped_count += clipped < unclipped
    n_masked = sum(sum(r) for r in mask)
    masked_sum = sum(per_tok[i][t] for i in range(N) for t in range(L) if mask[i][t])
    if loss_type == "grpo":
        seqs = []
        for i in range(N):
            n = sum(mask[i])
            seqs.append(sum(per_tok[i][t] for t in range(L) if mask[i][t]) / max(n, 1))
        loss = sum(seqs) / N
    elif loss_type in ("bnpo", "dapo"):
        loss = masked_sum / max(n_masked, 1)
    else:  # dr_grpo
        loss = masked_sum / (N * max_len)
    return loss, sum(kls) / max(n_masked, 1), clipped_count / max(n_masked, 1), sum(ratios) / max(n_masked, 1)


def ragged_mask(N: int, L: int, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, L + 1, (N,), generator=gen)
    lengths[0] = L  # at least one full row
    return (torch.arange(L)[None, :] < lengths[:, None]).float()


def _mean(xs):
    return sum(xs) / len(xs)


def _bessel_std(xs):  # a single value has no spread
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_rloo(rewards: list[float], G: int) -> list[float]:
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            out.append(r - _mean(others) if others else 0.0)
    return out


def ref_reinforce_pp(rewards: list[float], G: int, eps: float) -> list[float]:
    centred = []
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        centred += [r - _mean(group) for r in group]
    std = _bessel_std(centred)
    return [c / (std + eps) for c in centred]


def ref_gae(rewards, values, mask, gamma, lam):
    """Row by row, token by token from the end: the textbook recursion on lists."""
    advantages, returns = [], []
    for r, v, m in zip(rewards, values, mask):
        n = int(sum(m))  # real tokens are the row's first n
        adv = [0.0] * len(r)
        following = 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0  # the episode ends at the last real token
            delta = r[t] + gamma * next_value - v[t]
            following = delta + gamma * lam * following
            adv[t] = following
        advantages.append(adv)
        returns.append([adv[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return advantages, returns


def ref_whiten(x, mask, eps):
    counted = [x[i][t] for i in range(len(x)) for t in range(len(x[0])) if mask[i][t]]
    m = _mean(counted)
    var = sum((c - m) ** 2 for c in counted) / max(len(counted) - 1, 1)
    return [[(x[i][t] - m) / math.sqrt(var + eps) if mask[i][t] else 0.0 for t in range(len(x[0]))]
            for i in range(len(x))]


def ref_kl_token_rewards(sequence_rewards, kl, mask, kl_coef):
    out = []
    for reward, k, m in zip(sequence_rewards, kl, mask):
        row = [-kl_coef * k[t] if m[t] else 0.0 for t in range(len(k))]
        last = max(t for t in range(len(m)) if m[t])
        row[last] += reward
        out.append(row)
    return out


def ref_value_loss(values, old_values, returns, mask, clip):
    total, count, clipped_count = 0.0, 0, 0
    for v_row, o_row, r_row, m_row in zip(values, old_values, returns, mask):
        for v, o, r, m in zip(v_row, o_row, r_row, m_row):
            if not m:
                continue
            v_clipped = min(max(v, o - clip), o + clip)
            unclipped, clipped = (v - r) ** 2, (v_clipped - r) ** 2
            total += 0.5 * max(unclipped, clipped)
            clipped_count += clipped > unclipped
            count += 1
    return total / max(count, 1), clipped_count / max(count, 1)


def ref_entropy(logits, temperature):
    out = []
    for row in logits:
        entropies = []
        for z in row[:-1]:  # the last position predicts nothing that is scored
            scaled = [x / temperature for x in z]
            top = max(scaled)
            weights = [math.exp(x - top) for x in scaled]
            total = sum(weights)
            entropies.append(-sum(w / total * math.log(w / total) for w in weights if w > 0))
        out.append(entropies)
    return out


def ref_truncated_weights(old, sampler, mask, cap):
    return [[min(math.exp(o - s), cap) if m else 0.0 for o, s, m in zip(o_row, s_row, m_row)]
            for o_row, s_row, m_row in zip(old, sampler, mask)]


def ref_sampler_weights(old, sampler, mask, cap, mode, floor=None):
    """(weights, outside) of every sampler-correction mode, token by token (sequence modes: the product
    of the row's real tokens' ratios, exp of the sum of their log-ratios); ``floor`` the lower bound."""
    weights, over = [], []
    for o_row, s_row, m_row in zip(old, sampler, mask):
        if mode.startswith("sequence"):
            row_ratio = math.exp(sum(o - s for o, s, m in zip(o_row, s_row, m_row) if m))
            ratios = [row_ratio] * len(o_row)
        else:
            ratios = [math.exp(o - s) if m else 0.0 for o, s, m in zip(o_row, s_row, m_row)]
        w_row, over_row = [], []
        for ratio, m in zip(ratios, m_row):
            above = bool(m) and (ratio > cap or (floor is not None and ratio < floor))
            if not m:
                w = 0.0
            elif mode.endswith("truncate"):
                w = min(ratio, cap) if floor is None else max(min(ratio, cap), floor)
            else:
                w = 0.0 if above else ratio
            w_row.append(w)
            over_row.append(above)
        weights.append(w_row)
        over.append(over_row)
    return weights, over


def ref_sft_loss(logp, mask):
    """Mean over the masked tokens of -log p, token by token (0 without any)."""
    total, count = 0.0, 0
    for row_logp, row_mask in zip(logp, mask):
        for value, keep in zip(row_logp, row_mask):
            if keep:
                total -= value
                count += 1
    return total / count if count else 0.0


def ref_clip_ratios(ratio, adv, mask, eps_low, eps_high, per_sequence=False):
    """TRL 1.16's clip_ratio/* of one batch, one process, in loops: (low_mean, high_mean, region_mean, low_min,
    high_max). ``ratio``: [N][L] (at the sequence level each row's first entry is its ratio), ``adv``: [N]."""
    lows, highs, units, row_lows, row_highs = 0.0, 0.0, 0.0, [], []
    regions = 0.0
    for r, a, m in zip(ratio, adv, mask):
        flags = [(x < 1 - eps_low and a < 0, x > 1 + eps_high and a > 0) for x in (r[:1] if per_sequence else r)]
        weights = [1.0] if per_sequence else m
        row_low = sum(w * lo for (lo, _), w in zip(flags, weights))
        row_high = sum(w * hi for (_, hi), w in zip(flags, weights))
        lows, highs = lows + row_low, highs + row_high
        regions += sum(w * (lo or hi) for (lo, hi), w in zip(flags, weights))
        count = sum(weights)
        units += count
        row_lows.append(row_low / count if count else math.nan)
        row_highs.append(row_high / count if count else math.nan)
    finite_lows = [x for x in row_lows if not math.isnan(x)]
    finite_highs = [x for x in row_highs if not math.isnan(x)]
    return (lows / units, highs / units, regions / units, min(finite_lows) if finite_lows else math.nan,
            max(finite_highs) if finite_highs else math.nan)
