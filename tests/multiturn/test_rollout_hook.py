"""rollout_func (TRL's name): a user's own rollouts, checked and trained on exactly as returned: the tokens it
marks as the environment's carry no loss, its extra keys reach the rewards, bad output is a clear error."""

from __future__ import annotations

import dataclasses
import json

import pytest

from grpo import GRPOConfig, GRPOTrainer
from grpo.multiturn.rollout_hook import RolloutHook
from grpo.rollout.engine import SamplingParams


def two_turn_agent(prompts, trainer):
    """An 'external agent': samples a turn with the run's engine, inserts an observation, samples again. Called
    as TRL calls it, with the trainer (grpo's engine and sampling settings in ``trainer.rollout_context``)."""
    tok = trainer.processing_class
    G = trainer.num_generations
    context = trainer.rollout_context
    prompt_ids = [tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=False)
                  for p in prompts]
    half = dataclasses.replace(context.sampling, max_tokens=context.sampling.max_tokens - 24)  # room for turn 2
    first = context.engine.generate_ids(prompt_ids[::G], half, seed=context.seed)
    observation = tok("\nobservation: 42\n", add_special_tokens=False)["input_ids"]
    turns = [ids[m.bool()].tolist() + observation for ids, m in zip(first.completion_ids, first.completion_mask)]
    second = context.engine.generate_ids([p + t for p, t in zip(prompt_ids, turns)],
                                         SamplingParams(n=1, max_tokens=4, temperature=1.0), seed=context.seed)
    completions, masks = [], []
    for t, ids, m in zip(turns, second.completion_ids, second.completion_mask):
        tail = ids[m.bool()].tolist()
        completions.append(t + tail)
        masks.append([1] * (len(t) - len(observation)) + [0] * len(observation) + [1] * len(tail))
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None, "env_mask": masks,
            "trace": [f"agent-row-{i}" for i in range(len(prompts))]}


def test_a_rollout_func_trains_on_its_tokens_and_its_extra_keys_reach_the_rewards(tiny_model_dir, tmp_path):
    seen = []

    def uses_trace(completions, trace, **kwargs):
        seen.extend(trace)
        return [float(len(c[0]["content"]) % 3) for c in completions]

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(16)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=32, max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=2,
                      use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, seed=1)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=uses_trace, args=args, train_dataset=rows,
                          rollout_func=two_turn_agent)
    trainer.train()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert len(steps) == 2 and all(r["loss"] == r["loss"] for r in steps)  # finite
    # the observation's tokens are in the completion but not sampled: sampled length < completion length
    assert all(r["sampled_length/mean"] < r["completion_length/mean"] for r in steps)
    assert seen[:8] == [f"agent-row-{i}" for i in range(8)]


class _Tok:
    pad_token_id = 0

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))

    def batch_decode(self, rows, **kwargs):
        return [self.decode(r.tolist()) for r in rows]


@pytest.mark.parametrize("output, match", [
    ([], "returned list"),
    ({"prompt_ids": [[1]] * 2, "completion_ids": [[2]] * 2}, r"must return keys \['logprobs'\]"),
    ({"prompt_ids": [[1]] * 2, "completion_ids": [[2]] * 3, "logprobs": None}, "'completion_ids' has 3 rows for 2"),
    ({"prompt_ids": [[1]] * 2, "completion_ids": [[2, 3]] * 2, "logprobs": [[0.0]] * 2},
     "row 0's logprobs has 1 values for 2 completion tokens"),
    ({"prompt_ids": [[1]] * 2, "completion_ids": [[2, 3]] * 2, "logprobs": None, "env_mask": [[1]] * 2},
     "row 0's env_mask has 1 values"),
    ({"prompt_ids": [[1] * 9] * 2, "completion_ids": [[2]] * 2, "logprobs": None}, "over data.max_prompt_length 8"),
    ({"prompt_ids": [[1]] * 2, "completion_ids": [[2] * 6] * 2, "logprobs": None}, "over rollout.max_completion_length"),
    ({"prompt_ids": [[1]] * 2, "completion_ids": [[2, 3]] * 2, "logprobs": None, "env_mask": [[0, 0]] * 2},
     "row 0 has no sampled token"),
])
def test_bad_rollout_func_output_is_an_error_naming_the_function_and_row(output, match):
    from grpo.data import Example

    def my_agent(prompts, context):
        return output

    hook = RolloutHook(my_agent, engine=None, tokenizer=_Tok(), eos_ids=[7])
    example = Example([{"role": "user", "content": "q"}], answer="1", answer_raw="1", source="test:1")
    with pytest.raises(ValueError, match=match) as err:
        hook.rollout([example], None, 8, SamplingParams(n=2, max_tokens=4), seed=0)
    assert "my_agent" in str(err.value)
