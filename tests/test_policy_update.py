"""grpo.step.policy_update: the update over a rollout batch. Micro-batching must not change the gradient; old
log-probs, entropy, truncated-completion masking and sequence-level ratios reach the loss as they should."""

from __future__ import annotations

import pytest
import torch
from step_helpers import RecordingLearner, random_batch, settings_with

from grpo.models.tiny import build_qwen2
from grpo.step.micro_batches import rows_by_length
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import LossSettings
from grpo.parallel.distributed import DistInfo


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
        stats = train_on_batch(learner, batch, settings, DistInfo()).totals
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
        stats = train_on_batch(learner, batch, settings, DistInfo()).totals
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
    stats = train_on_batch(RecordingLearner(model), batch, settings_with(num_iterations=2), DistInfo()).totals
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
        train_on_batch(learner, batch, settings_with(mask_truncated_completions=mask_truncated), DistInfo()).totals
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
                           settings_with(importance_sampling_level="sequence", micro_batch_size=6), DistInfo()).totals
    assert stats["ratio_mean"] == pytest.approx(want.item(), abs=1e-6)
    token = train_on_batch(RecordingLearner(model), batch, settings_with(micro_batch_size=6), DistInfo()).totals
    assert token["ratio_mean"] != pytest.approx(stats["ratio_mean"], abs=1e-4)


class SmallSteps(RecordingLearner):
    """SGD steps small enough that iteration 2 is off-policy without the weights blowing up."""

    def finish_update(self):
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p -= 1e-3 * p.grad
        return super().finish_update()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_token_budget_micro_batches_give_the_fixed_row_gradient(tiny_tokenizer, loss_type, num_iterations):
    # train.max_tokens_per_micro_batch: micro-batches of 1-3 rows (whole groups where they fit, a group split
    # where one is too long) must give the same gradient, loss and statistics as fixed micro-batches of 2
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = random_batch(len(tiny_tokenizer), N=8, Lc=9, seed=3)
    batch.old_logprobs = None if num_iterations > 1 else batch.old_logprobs  # iteration 1 captures them
    results = {}
    for budget in (None, 30, 14, 1, "auto"):
        learner = SmallSteps(model) if num_iterations > 1 else RecordingLearner(model)
        with torch.no_grad():
            before = [p.clone() for p in model.parameters()]
        stats = train_on_batch(learner, batch, LossSettings(
            epsilon=0.2, epsilon_high=None, beta=0.04, loss_type=loss_type, max_completion_length=9, temperature=0.9,
            num_iterations=num_iterations, micro_batch_size=2 if budget in (None, "auto") else 8, max_grad_norm=None,
            max_tokens_per_micro_batch=budget), DistInfo()).totals
        results[budget] = (learner.grads, stats)
        with torch.no_grad():  # the same starting weights for every budget
            for p, b in zip(model.parameters(), before):
                p.copy_(b)
    fixed_grads, fixed_stats = results[None]
    for budget in (30, 14, 1, "auto"):
        grads, stats = results[budget]
        for key in ("loss", "kl", "clip_fraction", "ratio_mean", "entropy"):
            assert stats[key] == pytest.approx(fixed_stats[key], abs=1e-6, rel=1e-5), (budget, key)
        for update, fixed in zip(grads, fixed_grads, strict=True):
            for name, g in fixed.items():
                assert torch.allclose(update[name], g, atol=1e-6, rtol=1e-4), (budget, name, (update[name] - g).abs().max().item(), g.abs().max().item())


def test_token_budget_cuts_where_rows_times_the_widest_row_exceed_it():
    from grpo.step.micro_batches import token_budget_micro_batches

    completion = torch.tensor([1, 2, 2, 3, 6, 9])
    completion_mask = (torch.arange(9)[None] < completion[:, None]).long()
    prompt_mask = torch.ones(6, 3, dtype=torch.long)  # 3 prompt tokens each: widths 4, 5, 5, 6, 9, 12
    order = torch.arange(6)
    cut = token_budget_micro_batches(order, prompt_mask, completion_mask, max_rows=8, max_tokens=16)
    assert [m.tolist() for m in cut] == [[0, 1, 2], [3], [4], [5]]  # 3 x 5 = 15 fits, 4 x 6 does not; 2 x 9 neither
    cut = token_budget_micro_batches(order, prompt_mask, completion_mask, max_rows=2, max_tokens=10 ** 6)
    assert [m.tolist() for m in cut] == [[0, 1], [2, 3], [4, 5]]  # the row cap still holds
    cut = token_budget_micro_batches(order, prompt_mask, completion_mask, max_rows=8, max_tokens=1)
    assert [m.tolist() for m in cut] == [[i] for i in range(6)]  # a row over the budget runs alone
    assert [m.tolist() for m in token_budget_micro_batches(order, prompt_mask, completion_mask, 4, None)] == [
        [0, 1, 2, 3], [4, 5]]
    # auto: the largest 2-row micro-batch runs 2 x 12 = 24 padded tokens; within that, any number of rows
    cut = token_budget_micro_batches(order, prompt_mask, completion_mask, max_rows=2, max_tokens="auto")
    assert [m.tolist() for m in cut] == [[0, 1, 2, 3], [4, 5]]  # 4 x 6 = 24 and 2 x 12 = 24: 2 passes, not 3
    assert token_budget_micro_batches(order[:0], prompt_mask, completion_mask, 2, "auto") == []


def test_auto_budget_is_fixed_rows_on_cuda_and_under_deepspeed():
    from grpo.config import load_config
    from grpo.training.settings import loss_settings, micro_batch_tokens

    def budget(value, device_type, *extra):
        return micro_batch_tokens(load_config(None, [f"train.max_tokens_per_micro_batch={value}", *extra]),
                                  device_type)

    # On the H200 a step of auto's varying row counts ran its update in 2.5-4.4 s where fixed rows took
    # 2.1 s (new shapes: new kernels and attention plans); a CPU gains from the fewer passes
    assert budget("auto", "cpu") == "auto" and budget("auto", "cuda") is None
    assert budget("auto", "meta") == "auto"  # other device types: the CPU's
    assert budget(1792, "cuda") == 1792 and budget("null", "cpu") is None  # as given
    # DeepSpeed steps after a fixed number of micro-batches: auto is fixed rows there on any device
    assert budget("auto", "cpu", "train.deepspeed=configs/ds_zero2.json", "train.mode=decoupled") is None
    cfg = load_config(None, ["train.max_tokens_per_micro_batch=auto"])
    assert loss_settings(cfg, None, "cpu").max_tokens_per_micro_batch == "auto"
    assert loss_settings(cfg, None, "cuda").max_tokens_per_micro_batch is None