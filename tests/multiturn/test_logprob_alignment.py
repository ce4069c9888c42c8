"""A conversation's tokens are identical in the sampler, the old-policy, the reference and the training log-prob
passes (issue 27): a multi-turn rollout over a scripted engine is scored, finished and trained on, and every call
of ``completion_logprobs`` is spied on."""

from __future__ import annotations

import copy

import pytest
import torch
from step_helpers import RecordingLearner, settings_with
from test_driver import ScriptedEngine, calculator, call, example, qwen25_template

import grpo.step.experience as experience
import grpo.step.micro_batch_loss as micro_batch_loss
import grpo.step.policy_update as policy_update
from grpo.models.tiny import build_qwen2
from grpo.multiturn.driver import MultiTurnRollout
from grpo.rollout.engine import SamplingParams
from grpo.step.logprob_pass import LogprobPass
from grpo.parallel.distributed import DistInfo


class RecordingEngine(ScriptedEngine):
    """Also keeps what each call sampled: (contexts, [the sampled tokens of each context's rows])."""

    def generate_ids(self, prompt_ids, params, seed=None):
        out = super().generate_ids(prompt_ids, params, seed)
        self.calls[-1] = (self.calls[-1][0], [ids[m.bool()].tolist() for ids, m in
                                              zip(out.completion_ids, out.completion_mask)])
        return out


def spy_passes(monkeypatch) -> list[tuple[str, object, tuple]]:
    """Every completion_logprobs call as (who, model, (prompt_ids, prompt_mask, completion_ids, completion_mask))."""
    seen = []
    for module, who in ((experience, "rollout"), (micro_batch_loss, "train")):
        real = module.completion_logprobs

        def spy(model, *tensors, _real=real, _who=who, **kwargs):
            seen.append((_who, model, tuple(t.clone() for t in tensors[:4])))
            return _real(model, *tensors, **kwargs)

        monkeypatch.setattr(module, "completion_logprobs", spy)
    return seen


def test_the_old_reference_and_training_passes_see_the_sampled_conversation(tiny_tokenizer, monkeypatch):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = qwen25_template()

    def script(context, j):  # row 0 calls the calculator then answers; row 1 answers at once
        if "<tool_response>" not in context:
            return call("calculator", expression="2+3") if j == 0 else "<answer>4</answer><|im_end|>"
        return "<answer>5</answer><|im_end|>"

    engine = RecordingEngine(tokenizer, script)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    rollout = MultiTurnRollout(engine, tokenizer, eos, [calculator], None, None, 5.0)
    policy = build_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    reference = build_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=1)
    one_pass = LogprobPass(share_prompts=False, column_bucket=1)
    settings = experience.ExperienceSettings(
        sampling=SamplingParams(n=2, max_tokens=200, temperature=0.9), system_prompt="Use tools.",
        max_prompt_length=4096, advantage_estimator="grpo", scale_rewards=None, advantage_eps=1e-4,
        need_old_logprobs=True, logprob_batch_size=8, logprob_pass=one_pass)
    seen = spy_passes(monkeypatch)

    scored = experience.sample_and_score(rollout, tokenizer, [example("2+3?")],
                                         [lambda completions, **kw: [float(len(c)) for c in completions]], [1.0],
                                         settings, seed=0)
    ref_fn = experience.local_reference(policy, reference, 0.9, 8, logprob_pass=one_pass)
    batch = experience.finish_experience(scored, policy, ref_fn, settings)
    g = batch.generation
    assert g.loss_mask is not None and bool((g.loss_mask != g.completion_mask).any())  # row 0 has a tool result
    s = settings_with(beta=0.1, micro_batch_size=len(g.completions), max_completion_length=g.completion_ids.shape[1],
                      logprob_pass=one_pass)
    stats = policy_update.train_on_batch(RecordingLearner(policy), batch, s, DistInfo()).totals

    # The sampler's conversations: row 0 is its second context (prompt, first turn, tool result) and what it
    # sampled there; row 1 is the prompt and its first answer. The sampled tokens are each row's turns.
    (first_contexts, first_out), (second_contexts, second_out) = engine.calls
    conversations = [second_contexts[0] + second_out[0], first_contexts[0] + first_out[1]]
    sampled = [first_out[0] + second_out[0], first_out[1]]

    assert [(who, model) for who, model, _ in seen] == [("rollout", policy), ("rollout", reference), ("train", policy)]
    for who, _, (prompt_ids, prompt_mask, completion_ids, completion_mask) in seen:
        for row in range(2):
            ids = (prompt_ids[row][prompt_mask[row].bool()].tolist()
                   + completion_ids[row][completion_mask[row].bool()].tolist())
            assert ids == conversations[row], (who, row)
            assert completion_ids[row][g.loss_mask[row].bool()].tolist() == sampled[row], (who, row)
    # The same tensors in every pass, so the same log-probs: the first update's ratio is 1.
    first = seen[0][2]
    for _, _, tensors in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, tensors))
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and stats["clip_fraction"] == 0.0

