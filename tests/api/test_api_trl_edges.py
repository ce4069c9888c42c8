"""GRPOTrainer at the edges of TRL 1.16's interface (issue 42): tools with a system message in each prompt,
prompt lengths measured as the rollout renders them and refused in a TRL user's words, ``rollout_func(prompts,
trainer)``, TRL's checkpoint folders and resume rules, no plots or final save unless asked, one environment
instance per rollout (no extra probe)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import DataError
from grpo.multiturn.calculator import calculator

TINY_TOOLS = Path(__file__).resolve().parents[2] / "assets" / "tiny-tools"
SYSTEM = "You are a careful assistant. Use the calculator for any product of large numbers."


def args_for(out, **kwargs):
    defaults = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=2, max_completion_length=24,
                    max_steps=1, learning_rate=1e-3, logging_steps=1, save_steps=1, use_cpu=True, bf16=False,
                    gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=3)
    return GRPOConfig(**{**defaults, **kwargs})


def chat_rows(n, system=SYSTEM):
    return [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": f"What is {i} * 4821?"}],
             "answer": str(i * 4821)} for i in range(n)]


def number_reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c[-1]["content"])) for c in completions]


def rendered(messages):
    from transformers import AutoTokenizer

    from grpo.multiturn.tools import tool_schema

    tok = AutoTokenizer.from_pretrained(TINY_TOOLS)
    text = tok.apply_chat_template(messages, tools=[tool_schema(calculator)], tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_tools_with_a_system_message_train_and_prompt_lengths_count_both(tmp_path):
    out = tmp_path / "run"
    trainer = GRPOTrainer(str(TINY_TOOLS), number_reward, args_for(out), train_dataset=chat_rows(8),
                          tools=[calculator])
    assert trainer.train().global_step == 1  # as TRL: no prompt refused
    assert not (out / "final").exists() and not (out / "plots").exists()  # only when asked, as TRL

    # With a bound (here the user's own), a prompt is measured as the rollout renders it: system turn and tool
    # schema. Over it: refused before anything is written, in the API's words.
    longest = max(rendered(row["prompt"]) for row in chat_rows(4))
    assert longest > rendered(chat_rows(4)[3]["prompt"][1:])  # the system turn counts
    fresh = tmp_path / "fresh"
    GRPOTrainer(str(TINY_TOOLS), number_reward, args_for(fresh, grpo_overrides={"data.max_prompt_length": longest}),
                train_dataset=chat_rows(4), tools=[calculator])
    with pytest.raises(DataError, match=rf"train_dataset\[\d\]: the prompt with its tools \(rendered with its system "
                                        rf"message\) is {longest} tokens, over grpo_overrides\['data.max_prompt_length'"
                                        rf"\]={longest - 1}: shorten the prompt"):
        GRPOTrainer(str(TINY_TOOLS), number_reward,
                    args_for(fresh, grpo_overrides={"data.max_prompt_length": longest - 1}),
                    train_dataset=chat_rows(4), tools=[calculator])
    # vLLM samples within the model's context (512 positions here): said in TRL's terms.
    with pytest.raises(DataError, match=r"train_dataset\[3\]: .* with max_completion_length 24 it does not fit the "
                                        r"model's context of 512 tokens .* shorten the prompt"):
        GRPOTrainer(str(TINY_TOOLS), number_reward, args_for(fresh, use_vllm=True),
                    train_dataset=chat_rows(3) + chat_rows(1, system=SYSTEM * 25), tools=[calculator])
    assert not fresh.exists()


def test_start_up_measures_a_few_prompts_and_a_sampled_one_too_long_fails_before_its_update(tmp_path, monkeypatch):
    import grpo.api.prompt_lengths as prompts

    measured = []
    real = prompts.rendered_length
    monkeypatch.setattr(prompts, "rendered_length", lambda *a: measured.append(1) or real(*a))
    bounded = {"grpo_overrides": {"data.max_prompt_length": 200}}
    GRPOTrainer(str(TINY_TOOLS), number_reward, args_for(tmp_path / "a", **bounded), train_dataset=chat_rows(200))
    assert len(measured) == prompts.CHECKED_UP_FRONT  # not the whole dataset

    # A prompt past the up-front sample is measured when its step renders it: the same words, and the earlier
    # steps' checkpoints are kept.
    monkeypatch.setattr(prompts, "CHECKED_UP_FRONT", 0)
    out = tmp_path / "b"
    trainer = GRPOTrainer(str(TINY_TOOLS), number_reward, args_for(out, max_steps=2, shuffle_dataset=False, **bounded),
                          train_dataset=chat_rows(2) + chat_rows(2, system=SYSTEM * 25))
    with pytest.raises(DataError, match=r"train_dataset\[2\]: the prompt .* over grpo_overrides"):
        trainer.train()
    assert (out / "checkpoint-1" / "trainer_state.json").is_file() and not (out / "checkpoint-2").exists()


def test_rollout_func_gets_the_trainer_with_its_current_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = []

    def rollout_func(prompts, trainer):  # as TRL 1.16 calls it: rollout_func(prompts, self)
        assert trainer.model is model and trainer.args.max_completion_length == 24 and trainer.num_generations == 2
        weights.append(next(trainer.model.parameters()).detach().clone())
        tok = trainer.processing_class
        prompt_ids = [tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=False)
                      for p in prompts]
        completions = [tok(f"{i % 3} " * (1 + i % 4), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                       for i in range(len(prompts))]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
    trainer = GRPOTrainer(model, number_reward, args_for(tmp_path / "run", max_steps=2), train_dataset=rows,
                          rollout_func=rollout_func)
    trainer.train()
    assert len(weights) == 2 and not torch.equal(weights[0], weights[1])  # step 2 sampled with step 1's update

    def reads_accelerator(prompts, trainer):
        return trainer.accelerator.device

    trainer = GRPOTrainer(model, number_reward, args_for(tmp_path / "other"), train_dataset=rows,
                          rollout_func=reads_accelerator)
    with pytest.raises(AttributeError, match="grpo's GRPOTrainer has no attribute 'accelerator'.*rollout_context"):
        trainer.train()


@pytest.mark.slow
def test_checkpoints_and_resume_follow_trl(tiny_model_dir, tmp_path):
    """num_iterations=2: checkpoint-<optimizer update> with transformers' trainer_state.json; resuming from a
    named checkpoint trains from it (not from the newest) to the same weights and restores the log history, in
    its own output_dir or in another run's folder."""
    from transformers import AutoModelForCausalLM, TrainerState

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(16)]

    def run(resume=None, out=tmp_path / "run"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        args = args_for(out, per_device_train_batch_size=8, num_generations=4, max_steps=4, num_iterations=2,
                        save_steps=2)
        trainer = GRPOTrainer(model, number_reward, args, train_dataset=rows)
        return trainer, trainer.train(resume_from_checkpoint=resume)

    first, output = run()
    out = tmp_path / "run"
    assert output.global_step == 4 and sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2",
                                                                                            "checkpoint-4"]
    saved = TrainerState.load_from_json(str(out / "checkpoint-2" / "trainer_state.json"))
    assert saved.global_step == 2 and saved.log_history and all(e["step"] <= 2 for e in saved.log_history)
    assert json.loads((out / "checkpoint-2" / "grpo_state.json").read_text())["step"] == 1  # one grpo step
    assert not (out / "final").exists() and not (out / "plots").exists()

    resumed, output = run(resume=str(out / "checkpoint-2"))
    assert output.global_step == 4
    assert resumed.state.log_history[:len(saved.log_history)] == saved.log_history  # restored, then appended
    assert any(e["step"] > 2 for e in resumed.state.log_history)
    want, got = first.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)  # steps 3 and 4 retrained from checkpoint-2

    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-6"))

    # another run's checkpoint, as TRL resumes it: this run starts from its state and writes into its own folder
    elsewhere, output = run(resume=str(out / "checkpoint-2"), out=tmp_path / "other")
    assert output.global_step == 4 and elsewhere.state.log_history[:len(saved.log_history)] == saved.log_history
    assert sorted(p.name for p in (tmp_path / "other").glob("checkpoint-*")) == ["checkpoint-4"]
    got = elsewhere.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)  # the same steps 3 and 4 from the same state
    trl_written = tmp_path / "trl" / "checkpoint-2"  # TRL's own trainer writes no grpo_state.json
    shutil.copytree(out / "checkpoint-2", trl_written)
    (trl_written / "grpo_state.json").unlink()
    with pytest.raises(ValueError, match="has no grpo_state.json: grpo resumes the checkpoints it wrote"):
        elsewhere.train(resume_from_checkpoint=str(trl_written))
    with pytest.raises(ValueError, match="not a checkpoint folder of this run's shape"):
        elsewhere.train(resume_from_checkpoint=str(tmp_path / "trl"))
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        GRPOTrainer(str(tiny_model_dir), number_reward, args_for(tmp_path / "empty"),
                    train_dataset=rows).train(resume_from_checkpoint=True)
    assert [p.name for p in resumed.plot()][-1] == "summary.png"  # plots when asked


@pytest.mark.slow
def test_an_environment_factory_builds_one_instance_per_rollout_and_no_probe_more(tmp_path):
    built = []

    class Calculator:
        def __init__(self):
            built.append(self)

        def reset(self, **row):
            return None

        def multiply(self, a: int, b: int) -> int:
            """Multiply two numbers.

            Args:
                a: The first factor.
                b: The second factor.
            """
            return a * b

    trainer = GRPOTrainer(str(TINY_TOOLS), number_reward, args_for(tmp_path / "run"), train_dataset=chat_rows(8),
                          environment_factory=Calculator)
    assert len(built) == 1  # TRL's probe, which seeds the pool
    trainer.train()
    assert len(built) == 4  # per_device_train_batch_size 4 rollouts at once: the probe and three more


def test_a_datasets_dataset_is_read_a_row_when_sampled_and_its_columns_checked_at_once():
    from datasets import Dataset

    from grpo.api.datasets import LazyExamples, to_examples

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} + 1?"}],
             "answer": str(i + 1)} for i in range(1000)]
    examples = to_examples(Dataset.from_list(rows), "train_dataset")
    assert isinstance(examples, LazyExamples) and len(examples) == 1000 and list(examples.made) == [0]
    eager = to_examples(rows, "train_dataset")  # a list of dicts: converted at once, the same records
    assert examples[997] == eager[997] and examples[-1] == eager[-1] and sorted(examples.made) == [0, 997, 999]
    assert examples[997].system == "Be brief." and examples[997].columns() == {"answer": "998"}
    with pytest.raises(DataError, match=r"train_dataset\[0\]: no 'prompt' column"):
        to_examples(Dataset.from_list([{"question": "?"}]), "train_dataset")
    mixed = Dataset.from_list([{"prompt": "text", "answer": "1"}, {"prompt": "more text", "answer": None}])
    assert to_examples(mixed, "train_dataset")[1].answer is None
