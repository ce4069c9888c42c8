"""grpo.step.policy_update: the update over a rollout batch. Micro-batching must not change the gradient; old
log-probs, entropy, truncated-completion masking and sequence-level ratios reach the loss as they should."""

from __future__ import annotations

import pytest
import torch
from step_helpers import RecordingLearner, random_batch, settings_with

from grpo.models.tiny import build_qwen2
from grpo.step.policy_update import LossSettings, rows_by_length, train_on_batch
from grpo.training.distributed import DistInfo


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(tiny_tokenizer, loss_type):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    grads = {}
    for micro in (6, 2, 1):
        learner = RecordingLearner(model)
        settings = LossSettings(epsilon=0.2, epsilon_high=None, beta=0.04, loss_type=loss_type,
                                max_completion_length=7, temperature=0.9, num_iterations=1,
                                micro_batch_size=micro, max_grad_norm=None)
        stats = train_on_batch(learner, batch, settings, DistInfo())
        grads[micro] = (learner.grads[0], stats["loss"])
    whole, whole_loss = grads[6]
    for micro in (2, 1):
        part, part_loss = grads[micro]
        assert abs(part_loss - whole_loss) < 1e-5
        for name, g in whole.items():
            assert torch.allclose(part[name], g, atol=1e-6, rtol=1e-4), (micro, name)


def test_micro_batches_take_whole_groups_by_length():
    # Groups of 2 whose longest completions are 5, 2, 7, 2 tokens: shortest first, ties in batch order,
    # each group's rows together (their prompt pass is shared).
    lengths = torch.tensor([5, 1, 2, 2, 3, 7, 1, 2])
    mask = (torch.arange(8)[None] < lengths[:, None]).long()
    assert rows_by_length(mask, 2).tolist() == [2, 3, 6, 7, 0, 1, 4, 5]


class SteppingLearner(RecordingLearner):
    """Records each update's gradient and then applies a plain SGD step, so iteration 2 sees new weights."""

    def finish_update(self):
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
        return super().finish_update()


def test_old_logprobs_taken_from_the_first_iteration_equal_a_separate_pass(tiny_tokenizer):
    # Colocated runs with num_iterations > 1 no longer compute old log-probs in a pass of their own:
    # train_on_batch keeps the first iteration's (the weights have not moved since sampling). Both
    # ways must give the same updates, also in the second iteration where the ratio departs from 1.
    from grpo.step.logprobs import completion_logprobs

    results = []
    for precomputed in (True, False):
        model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
        batch = random_batch(len(tiny_tokenizer))
        g = batch.generation
        with torch.no_grad():
            old = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, 0.9)
        batch.old_logprobs = old if precomputed else None
        learner = SteppingLearner(model)
        settings = LossSettings(epsilon=0.2, epsilon_high=None, beta=0.04, loss_type="grpo", max_completion_length=7,
                                temperature=0.9, num_iterations=2, micro_batch_size=2, max_grad_norm=None)
        stats = train_on_batch(learner, batch, settings, DistInfo())
        results.append((learner.grads, stats))
    (grads_a, stats_a), (grads_b, stats_b) = results
    assert stats_b["clip_fraction"] == pytest.approx(stats_a["clip_fraction"])
    assert stats_b["loss"] == pytest.approx(stats_a["loss"], abs=1e-6)
    assert len(grads_a) == len(grads_b) == 2
    for update_a, update_b in zip(grads_a, grads_b):
        for name, grad in update_a.items():
            assert torch.allclose(update_b[name], grad, atol=1e-6, rtol=1e-4), name
    assert stats_a["ratio_mean"] != pytest.approx(1.0, abs=1e-4)  # iteration 2 really was off-policy


def test_entropy_is_the_token_mean_over_the_sampled_tokens(tiny_tokenizer):
    # train_on_batch reads the entropy off its own forward (shared prompt pass, trimmed columns, micro-batches
    # sorted by length); a plain full-sequence forward of each row, scored by token_entropy, must agree.
    from grpo.algorithm import token_entropy

    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    g = batch.generation
    with torch.no_grad():
        logits = model(input_ids=torch.cat([g.prompt_ids, g.completion_ids], 1),
                       attention_mask=torch.cat([g.prompt_mask, g.completion_mask], 1),
                       position_ids=(torch.cat([g.prompt_mask, g.completion_mask], 1).cumsum(-1) - 1).clamp(min=0)
                       ).logits  # [N, Lp + Lc, V]
    Lp = g.prompt_ids.shape[1]
    entropy = token_entropy(logits[:, Lp - 1:], temperature=0.9)  # [N, Lc]: the positions predicting completions
    want = (entropy * g.completion_mask).sum() / g.completion_mask.sum()
    stats = train_on_batch(RecordingLearner(model), batch, settings_with(num_iterations=2), DistInfo())
    assert stats["entropy"] == pytest.approx(want.item(), abs=1e-5)  # float32 forward passes of different shapes


def test_mask_truncated_completions_takes_truncated_rows_out_of_the_loss(tiny_tokenizer):
    # beta 0 and grpo aggregation: a row without loss tokens adds 0 to the mean over rows, exactly as a row
    # whose advantage is 0. So masking truncated rows must give the gradient of zeroing their advantages.
    grads = []
    for mask_truncated in (True, False):
        model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
        batch = random_batch(len(tiny_tokenizer))
        batch.generation.truncated = torch.tensor([True, False, False, True, False, False])
        if not mask_truncated:
            batch.advantages = batch.advantages.masked_fill(batch.generation.truncated, 0.0)
        learner = RecordingLearner(model)
        train_on_batch(learner, batch, settings_with(mask_truncated_completions=mask_truncated), DistInfo())
        grads.append(learner.grads[0])
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, atol=1e-7, rtol=1e-5), name


def test_sequence_level_ratios_reach_the_loss(tiny_tokenizer):
    # The batch's old log-probs are not the model's: ratios differ from 1. At the sequence level every
    # token carries its row's exp(mean log-ratio), so ratio_mean is their token-weighted mean (one
    # micro-batch: with several, grpo weighs each one's token mean by its rows).
    from grpo.step.logprobs import completion_logprobs

    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer))
    g = batch.generation
    mask = g.completion_mask.float()
    with torch.no_grad():
        logp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, 0.9)
    row_ratio = torch.exp(((logp - batch.old_logprobs) * mask).sum(-1) / mask.sum(-1))  # [N]
    want = (row_ratio * mask.sum(-1)).sum() / mask.sum()
    stats = train_on_batch(RecordingLearner(model), batch,
                           settings_with(importance_sampling_level="sequence", micro_batch_size=6), DistInfo())
    assert stats["ratio_mean"] == pytest.approx(want.item(), abs=1e-6)
    token = train_on_batch(RecordingLearner(model), batch, settings_with(micro_batch_size=6), DistInfo())
    assert token["ratio_mean"] != pytest.approx(stats["ratio_mean"], abs=1e-4)
