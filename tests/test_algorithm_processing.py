"""grpo.algorithm.processing: the log-probs of the processed sampling distribution (repetition penalty,
min_new_tokens, min_p) against a plain-Python loop, a hand-computed case, transformers' own
processors, and gradients (gradcheck in float64, and plain autograd through the loop)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm.processing import (LogprobProcessing, min_p_removed, penalize_repeats, processed_token_entropy,
                                       processed_token_logprobs, prompt_presence)


def loop_logprobs(logits, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, proc,
                  entropy=False):
    """One row, one position, one vocabulary entry at a time, in float64 (differentiable)."""
    B, L, V = logits.shape
    rows = []
    for b in range(B):
        prompt = {int(t) for t, m in zip(prompt_ids[b], prompt_mask[b]) if m}  # left padding never counts
        out = []
        for t in range(L):
            seen = prompt | {int(x) for x in completion_ids[b, :t]}
            values = []
            for v in range(V):
                x = logits[b, t, v].double()
                if proc.repetition_penalty != 1.0 and v in seen:
                    x = x * proc.repetition_penalty if x < 0 else x / proc.repetition_penalty
                x = x / temperature
                if completion_mask[b, t] and t < proc.min_new_tokens and v in proc.eos_ids:
                    x = x.new_tensor(-math.inf)  # a constant: no gradient
                values.append(x)
            target = int(completion_ids[b, t])
            if proc.min_p > 0:
                top = max(float(x.detach()) for x in values)
                total = sum(math.exp(float(x.detach()) - top) for x in values)
                threshold = proc.min_p * (1.0 / total)  # the top token's probability is exp(0) / total
                values = [x if (math.exp(float(x.detach()) - top) / total >= threshold or v == target) else x.new_tensor(-math.inf)
                          for v, x in enumerate(values)]
            stacked = torch.stack(values)
            if entropy:
                p = torch.softmax(stacked, 0)
                out.append(torch.special.entr(p).sum())
            else:
                out.append(stacked[target] - torch.logsumexp(stacked, 0))
        rows.append(torch.stack(out))
    return torch.stack(rows)


def case(seed, B=3, Lp=5, L=6, V=11, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, L, V, generator=gen) * 3).to(dtype)
    prompt_ids = torch.randint(0, V, (B, Lp), generator=gen)
    prompt_mask = torch.ones(B, Lp, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left-padded prompts: their pad ids must not count as seen
    prompt_mask[B - 1, : Lp - 1] = 0
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(0, V, (B, L), generator=gen)
    lengths = torch.tensor([L, 3, 1])[-B:]  # ragged completions; padding ids are EOS ids here (pad == eos)
    completion_mask = (torch.arange(L)[None] < lengths[:, None]).long()
    completion_ids[completion_mask == 0] = 2
    return logits, prompt_ids, prompt_mask, completion_ids, completion_mask


CONTROLS = [LogprobProcessing(repetition_penalty=1.3),
            LogprobProcessing(repetition_penalty=0.8),
            LogprobProcessing(min_new_tokens=4, eos_ids=(2, 5)),
            LogprobProcessing(min_p=0.2),
            LogprobProcessing(repetition_penalty=1.5, min_new_tokens=2, min_p=0.1, eos_ids=(2,))]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("proc", CONTROLS)
@pytest.mark.parametrize("chunk", [1, 4, None])  # 4 does not divide L = 6; None: one chunk
def test_vectorised_matches_the_loop(seed, proc, chunk):
    # float64 logits: both sides then compute in float64 and agree to rounding
    logits, p_ids, p_mask, c_ids, c_mask = case(seed, dtype=torch.float64)
    # EOS targets at real positions before min_new_tokens cannot have been sampled: replace them
    early = (c_mask == 1) & (torch.arange(c_ids.shape[1]) < proc.min_new_tokens) & torch.isin(c_ids, torch.tensor([2, 5]))
    c_ids = c_ids.masked_fill(early, 7)
    seen = prompt_presence(p_ids, p_mask, logits.shape[-1])
    got = processed_token_logprobs(logits, c_ids, c_mask, seen, 0.7, proc, chunk_columns=chunk)
    want = loop_logprobs(logits, p_ids, p_mask, c_ids, c_mask, 0.7, proc)
    assert torch.isfinite(got).all()  # padding targets equal to EOS stay finite too
    assert torch.allclose(got, want, atol=1e-9, rtol=0)
    entropy = processed_token_entropy(logits, c_ids, c_mask, seen, 0.7, proc, chunk_columns=chunk)
    assert torch.allclose(entropy, loop_logprobs(logits, p_ids, p_mask, c_ids, c_mask, 0.7, proc, True),
                          atol=1e-9, rtol=0)
    # float32 logits (the trainer's): within float32 rounding of the float64 loop
    got32 = processed_token_logprobs(logits.float(), c_ids, c_mask, seen, 0.7, proc, chunk_columns=chunk)
    assert got32.dtype == torch.float32
    assert torch.allclose(got32.double(), want, atol=1e-5, rtol=0)


def test_the_controls_change_the_log_probs():
    # so that the agreement above cannot come from a pass that ignores them
    from grpo.algorithm import token_logprobs

    logits, p_ids, p_mask, c_ids, c_mask = case(0)
    seen = prompt_presence(p_ids, p_mask, logits.shape[-1])
    plain = token_logprobs(torch.cat([logits, logits[:, -1:]], 1), torch.cat([c_ids[:, :1], c_ids], 1), 0.7)
    off = processed_token_logprobs(logits, c_ids, c_mask, seen, 0.7, LogprobProcessing())
    assert torch.allclose(off, plain, atol=1e-6)
    for proc in (LogprobProcessing(repetition_penalty=1.3), LogprobProcessing(min_p=0.2)):
        assert (processed_token_logprobs(logits, c_ids, c_mask, seen, 0.7, proc) - plain).abs().max() > 0.01


def test_hand_computed_case():
    # V = 4, one position, raw logits [2, -1, 0.5, 0], temperature 1. The prompt holds tokens 0 and 1.
    # repetition_penalty 2: 2 > 0 becomes 2 / 2 = 1; -1 < 0 becomes -1 * 2 = -2 -> [1, -2, 0.5, 0].
    # min_p 0.3: probabilities ~ e^1, e^-2, e^0.5, e^0 = 2.718, 0.135, 1.649, 1 (divided by their sum);
    # the threshold is 0.3 * 2.718 = 0.815 (before the division), so token 1 (0.135) is removed.
    #   target 2: 0.5 - log(e^1 + e^0.5 + e^0)                       = -1.1803
    #   target 1 (the removed token, as under updated weights, joins the kept set):
    #             -2 - log(e^1 + e^-2 + e^0.5 + e^0)                 = -3.7053
    # min_new_tokens 1 with EOS 3: token 3 is forbidden at position 0: target 2 gives
    #             0.5 - log(e^1 + e^0.5)                              = -0.9741
    logits = torch.tensor([[[2.0, -1.0, 0.5, 0.0]]])
    seen = torch.tensor([[True, True, False, False]])
    mask = torch.ones(1, 1)
    proc = LogprobProcessing(repetition_penalty=2.0, min_p=0.3)
    target2 = processed_token_logprobs(logits, torch.tensor([[2]]), mask, seen, 1.0, proc)
    target1 = processed_token_logprobs(logits, torch.tensor([[1]]), mask, seen, 1.0, proc)
    assert target2.item() == pytest.approx(0.5 - math.log(math.e + math.exp(0.5) + 1), abs=1e-6)
    assert target2.item() == pytest.approx(-1.1803, abs=1e-4)
    assert target1.item() == pytest.approx(-2 - math.log(math.e + math.exp(-2) + math.exp(0.5) + 1), abs=1e-6)
    eos = LogprobProcessing(repetition_penalty=2.0, min_p=0.3, min_new_tokens=1, eos_ids=(3,))
    got = processed_token_logprobs(logits, torch.tensor([[2]]), mask, seen, 1.0, eos)
    assert got.item() == pytest.approx(0.5 - math.log(math.e + math.exp(0.5)), abs=1e-6)


def test_primitives_equal_transformers_processors():
    from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor)

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 30, generator=gen) * 3
    ids = torch.randint(0, 30, (4, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: HF's prompt_ignore_length is the first real position
    # one row at a time: an int prompt_ignore_length is what every transformers release in range takes
    want = torch.cat([RepetitionPenaltyLogitsProcessor(1.4, prompt_ignore_length=first)(ids[i:i + 1], scores[i:i + 1].clone())
                      for i, first in enumerate([0, 3, 0, 0])])
    assert torch.equal(penalize_repeats(scores, prompt_presence(ids, mask, 30), 1.4), want)
    want = MinPLogitsWarper(0.15)(ids, scores.clone())
    assert torch.equal(torch.isinf(want), min_p_removed(scores, 0.15))
    want = MinNewTokensLengthLogitsProcessor(7, 3, [4, 9])(ids, scores.clone())  # 2 new tokens < 3: EOS out
    assert torch.isinf(want[:, [4, 9]]).all() and torch.isfinite(want[:, [0, 1, 2, 3]]).all()


@pytest.mark.parametrize("proc", CONTROLS)
def test_gradcheck_float64(proc):
    logits, p_ids, p_mask, c_ids, c_mask = case(3, B=2, Lp=3, L=3, V=6, dtype=torch.float64)
    logits.requires_grad_(True)
    seen = prompt_presence(p_ids, p_mask, 6)
    c_ids = c_ids.masked_fill((c_mask == 1) & (torch.arange(3) < proc.min_new_tokens) & torch.isin(c_ids, torch.tensor([2, 5])), 1)
    assert torch.autograd.gradcheck(
        lambda x: processed_token_logprobs(x, c_ids, c_mask, seen, 0.7, proc, chunk_columns=2), (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_matches_autograd_through_the_loop(dtype):
    proc = LogprobProcessing(repetition_penalty=1.5, min_new_tokens=2, min_p=0.1, eos_ids=(2,))
    logits, p_ids, p_mask, c_ids, c_mask = case(4, dtype=dtype)
    c_ids = c_ids.masked_fill((c_mask == 1) & (torch.arange(c_ids.shape[1]) < 2) & (c_ids == 2), 7)
    weights = torch.randn(c_ids.shape, generator=torch.Generator().manual_seed(5)) * c_mask
    x = logits.clone().requires_grad_(True)
    seen = prompt_presence(p_ids, p_mask, logits.shape[-1])
    (processed_token_logprobs(x, c_ids, c_mask, seen, 0.7, proc, chunk_columns=4) * weights).sum().backward()
    y = logits.clone().requires_grad_(True)
    (loop_logprobs(y, p_ids, p_mask, c_ids, c_mask, 0.7, proc) * weights).sum().backward()
    assert x.grad.dtype == dtype
    # float32: within rounding of gradients up to ~5; bf16: the two round the same float gradient to bf16 apart by at most one unit in the last place
    assert torch.allclose(x.grad.double(), y.grad.double(), atol=1e-6, rtol=1e-6 if dtype == torch.float32 else 2 ** -7)
