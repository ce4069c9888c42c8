"""The update queues work for the GPU without waiting for it: no host sync per micro-batch.

A CPU has no real syncs to see, so the ops that would be one on a GPU are counted instead: reading a
tensor's value on the host (``item``/``float``/``int``/``bool``, all ``aten._local_scalar_dense``),
``tolist``, and ops whose output size depends on the data (``nonzero``, ``masked_select``). A sync per
micro-batch makes the count grow with the number of micro-batches.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from step_helpers import CountSyncs, grpo_caller, random_batch

from grpo.data.sft_tokens import TokenizedPair
from grpo.models.tiny import build_qwen2
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import LossSettings
from grpo.step.ptx import collate
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import TorchLearner


def count_syncs(tiny_tokenizer, loss_type: str, micro_batch_size: int, monkeypatch, processing=None,
                ptx=None, mini_batches: int = 1, old_logprobs: bool = True) -> Counter[str]:
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    # SGD, not AdamW: torch's non-fused AdamW reads its step counters (CPU tensors even on a GPU run)
    # with item(), which this count would take for syncs of the learner's.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = TorchLearner(model, optimizer, scheduler, max_grad_norm=1.0)
    settings = LossSettings(epsilon=0.2, epsilon_high=None, beta=0.04, loss_type=loss_type, max_completion_length=7,
                            temperature=0.9, num_iterations=2, micro_batch_size=micro_batch_size, max_grad_norm=1.0,
                            processing=processing, ptx_coef=0.1, mini_batches=mini_batches)
    counter = CountSyncs()
    real_tolist = torch.Tensor.tolist

    def tolist(tensor):
        counter.by_file[grpo_caller()] += 1
        return real_tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    batch = random_batch(len(tiny_tokenizer), N=8)
    if not old_logprobs:  # the update's own: a no-grad pass over the later mini-batches first
        batch.old_logprobs = None
    with counter:
        stats = train_on_batch(learner, batch, settings, DistInfo(), ptx).totals
    monkeypatch.undo()
    assert stats["skipped_updates"] == 0.0 and stats["grad_norm"] > 0
    return counter.by_file


@pytest.mark.parametrize("loss_type,with_ptx", [("grpo", False), ("bnpo", False), ("dapo", False), ("grpo", True)])
@pytest.mark.parametrize("controls", [False, True])  # the sampling controls' log-probs (grpo.algorithm.processing)
def test_no_host_sync_per_micro_batch(tiny_tokenizer, monkeypatch, loss_type, with_ptx, controls):
    # loss types: weights a float, a tensor; dapo's share. PTX: its NLL joins the step's one transfer.
    from grpo.algorithm import LogprobProcessing

    processing = LogprobProcessing(1.3, 3, 0.05, (tiny_tokenizer.eos_token_id,)) if controls else None
    pairs = [TokenizedPair([5, 6, 7], [8, 9, 2], "p:1"), TokenizedPair([10], [12, 2], "p:2")]
    ptx = collate(pairs, pad_id=0) if with_ptx else None
    one, four = (count_syncs(tiny_tokenizer, loss_type, micro, monkeypatch, processing, ptx) for micro in (8, 2))
    # grpo/step/logprobs.py is left out: its column trimming reads the rollout's masks, which live on the CPU
    # (every engine returns them there), so those reads wait for no GPU. Everything else must not grow.
    for counts in (one, four):
        counts.pop("step/logprobs.py", None)
    assert four == one, f"syncs with 1 micro-batch per update: {dict(one)}; with 4: {dict(four)}"
    # The learner's one sync per update (2 updates: num_iterations=2): reading the gradient norm, which
    # decides whether the update is skipped.
    assert four["parallel/learners.py"] == 2, dict(four)
    # And the statistics come to the host once per step; the PTX loss reads nothing on the host.
    assert four["step/update_stats.py"] == 1 and "step/policy_update.py" not in four, dict(four)
    assert not {"step/ptx.py", "algorithm/losses.py", "algorithm/sampler_correction.py"} & set(four), dict(four)
@pytest.mark.parametrize("old_logprobs", [True, False])
def test_mini_batches_sync_once_per_update_and_once_for_the_stats(tiny_tokenizer, monkeypatch, old_logprobs):
    # 2 passes x 2 mini-batches: the learner's 4 gradient norms, the statistics' one transfer; splitting the batch,
    # the dapo normaliser over the mini-batches and the no-grad pass for the old log-probs read nothing on the host.
    counts = count_syncs(tiny_tokenizer, "dapo", 2, monkeypatch, mini_batches=2, old_logprobs=old_logprobs)
    counts.pop("step/logprobs.py", None)  # the rollout's masks, on the CPU (see above)
    assert counts == {"parallel/learners.py": 4, "step/update_stats.py": 1}, dict(counts)


