"""train.mini_batches (TRL's steps_per_generation / gradient_accumulation_steps, PPO's mini-batches): a step's k
updates per pass are k ordinary updates, each on its own whole-group mini-batch, every ratio to the weights that
started the step (old log-probs taken before the first update), dapo's token normaliser TRL's."""

from __future__ import annotations

import pytest
import torch
from step_helpers import RecordingLearner, random_batch, settings_with

from grpo.models.tiny import build_qwen2
from grpo.parallel.distributed import DistInfo
from grpo.step import policy_update
from grpo.step.batching import mini_batches, select_groups
from grpo.step.logprobs import completion_logprobs
from grpo.step.policy_update import train_on_batch

TEMPERATURE = 0.9  # settings_with's
RATE = 0.1  # SGD's: four updates at 0.5 take this tiny model to NaN


class SgdLearner(RecordingLearner):
    """Records each update's gradient, then steps plain SGD at ``rates[u]`` for update ``u`` (RATE by default), so
    that later updates see moved weights."""

    def __init__(self, module, rates: list[float] | None = None):
        super().__init__(module)
        self.rates = list(rates or [])

    def finish_update(self):
        rate = self.rates[len(self.grads)] if self.rates else RATE
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p -= rate * p.grad
        return super().finish_update()


def tiny_model(tokenizer):
    return build_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)


def test_groups_are_dealt_whole_into_the_mini_batches(tiny_tokenizer):
    batch = random_batch(len(tiny_tokenizer), N=12)  # 6 groups of 2 rows
    parts = mini_batches(batch, 3)
    for index, part in enumerate(parts):  # group i goes to mini-batch i % 3: rows 2i and 2i + 1
        rows = [2 * index, 2 * index + 1, 2 * index + 6, 2 * index + 7]
        assert torch.equal(part.generation.completion_ids, batch.generation.completion_ids[rows])
        assert torch.equal(part.advantages, batch.advantages[rows])  # the step's advantages, not recomputed
        assert torch.equal(part.old_logprobs, batch.old_logprobs[rows])
        assert len(part.prompts) == 2
    assert mini_batches(batch, 1)[0] is batch  # one mini-batch: the batch itself, nothing copied
    with pytest.raises(ValueError, match="train.mini_batches 4 does not divide this rank's 6 prompt groups"):
        mini_batches(batch, 4)


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_k_mini_batch_updates_are_k_updates_from_the_steps_old_policy(tiny_tokenizer, loss_type, num_iterations):
    k = 2
    batch = random_batch(len(tiny_tokenizer), N=8, seed=3)  # 4 groups of 2: mini-batches of groups {0, 2}, {1, 3}
    g = batch.generation
    with torch.no_grad():  # the old policy's log-probs, before any update
        old = completion_logprobs(tiny_model(tiny_tokenizer), g.prompt_ids, g.prompt_mask, g.completion_ids,
                                  g.completion_mask, TEMPERATURE)  # [8, Lc]
    batch.ref_logprobs = old - 0.05  # a reference near the policy (random_batch's random ones blow the KL up)
    batch.old_logprobs = None  # colocated: the update takes the old policy's log-probs itself
    one_update = settings_with(loss_type=loss_type, beta=0.04)  # an ordinary step of one update
    model = tiny_model(tiny_tokenizer)
    stats = train_on_batch(SgdLearner(model), batch, settings_with(
        loss_type=loss_type, beta=0.04, num_iterations=num_iterations, mini_batches=k), DistInfo())

    # By hand: ordinary one-update steps on each mini-batch, with the old log-probs from before the first.
    reference = tiny_model(tiny_tokenizer)
    rows = [[0, 1, 4, 5], [2, 3, 6, 7]]
    parts = [select_groups(batch, [0, 2]), select_groups(batch, [1, 3])]
    for part, part_rows in zip(parts, rows):
        part.old_logprobs = old[part_rows]
    # dapo: TRL divides each update's token sum by the generation's tokens / k (num_items_in_batch rescaled to one
    # update), not by the update's own tokens as an ordinary step does: the ordinary gradient times own / (all / k).
    tokens = [float(g.completion_mask[part_rows].sum()) for part_rows in rows]
    scale = [t * k / sum(tokens) if loss_type == "dapo" else 1.0 for t in tokens]
    learner = SgdLearner(reference, [RATE * scale[j] for _ in range(num_iterations) for j in range(k)])
    losses = [train_on_batch(learner, part, one_update, DistInfo()).totals["loss"] * scale[j]
              for _ in range(num_iterations) for j, part in enumerate(parts)]

    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), name
    assert [u.loss for u in stats.updates] == pytest.approx(losses, abs=1e-6)
    assert stats.totals["loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-7)  # the mean over updates

    # The old log-probs matter at this tolerance: each mini-batch on-policy to the weights it meets is another step.
    on_policy = tiny_model(tiny_tokenizer)
    learner = SgdLearner(on_policy, [RATE * scale[j] for _ in range(num_iterations) for j in range(k)])
    for part in parts:
        part.old_logprobs = None
    for _ in range(num_iterations):
        for part in parts:
            train_on_batch(learner, part, one_update, DistInfo())
    assert not all(torch.allclose(p, q, atol=1e-6, rtol=1e-5) for p, q in zip(model.parameters(),
                                                                             on_policy.parameters()))


def test_the_updates_losses_at_the_steps_weights_average_to_the_steps_loss(tiny_tokenizer):
    # With no update between them (a learner that does not step), the k updates' losses are k parts of the step's:
    # their mean is the loss of the whole batch in one update, for dapo through TRL's normaliser (all / k).
    batch = random_batch(len(tiny_tokenizer), N=8, seed=4)
    model = tiny_model(tiny_tokenizer)
    for loss_type in ("grpo", "dr_grpo", "dapo"):  # bnpo's token mean per mini-batch is not a mean of parts
        whole = train_on_batch(RecordingLearner(model), batch, settings_with(loss_type=loss_type), DistInfo())
        split = train_on_batch(RecordingLearner(model), batch, settings_with(loss_type=loss_type, mini_batches=4),
                               DistInfo())
        assert len(split.updates) == 4
        assert split.totals["loss"] == pytest.approx(whole.totals["loss"], abs=1e-6), loss_type
        assert split.totals["entropy"] == pytest.approx(whole.totals["entropy"], abs=1e-6)  # the step's tokens


@pytest.mark.parametrize("mini, num_iterations, given_old, passes", [
    (1, 2, False, 0),  # one mini-batch: the first update's own log-probs serve the second pass, as before
    (2, 1, False, 1),  # the second mini-batch's, before the first update moves the weights
    (4, 2, False, 3),
    (2, 2, True, 0),  # the rollout brought them
])
def test_old_logprobs_are_one_no_grad_pass_before_the_first_update(tiny_tokenizer, monkeypatch, mini, num_iterations,
                                                                   given_old, passes):
    batch = random_batch(len(tiny_tokenizer), N=8)
    if not given_old:
        batch.old_logprobs = None
    model = tiny_model(tiny_tokenizer)
    start = [p.detach().clone() for p in model.parameters()]
    seen = []

    def recording(module, inputs, s):
        seen.append(all(torch.equal(p, q) for p, q in zip(module.parameters(), start)))
        return real(module, inputs, s)

    real = policy_update.start_logprobs
    monkeypatch.setattr(policy_update, "start_logprobs", recording)
    learner = SgdLearner(model)
    train_on_batch(learner, batch, settings_with(num_iterations=num_iterations, mini_batches=mini), DistInfo())
    assert seen == [True] * passes  # every pass at the step's starting weights
    assert len(learner.grads) == num_iterations * mini
