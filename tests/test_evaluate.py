"""Evaluation: metrics computed exactly from known completions (a scripted engine), pass@k against
hand values, and the ``grpo eval`` job end to end on a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch

from grpo.data import Example, write_gsm8k_jsonl
from grpo.data.tags import get_tag_style
from grpo.rollout.generation import Generation
from grpo.tasks import resolve_task
from grpo.commands.eval_command import run_eval_command
from grpo.evaluation.evaluate import evaluate, pass_at_k


def example(question: str, answer: str | None, index: int) -> Example:
    return Example(messages=[{"role": "user", "content": question}], answer=answer, answer_raw=answer,
                   source=f"test:{index}", solution=None)


GOOD = "<think>\nwork\n</think>\n<answer>\n{}\n</answer>"


class ScriptedEngine:
    """Returns completions looked up by (question, greedy?) and records every call.

    ``script[question]`` = (greedy completion, [sampled completions]); a question is found inside the
    rendered prompt, so the engine also proves the prompt holds it.
    """

    def __init__(self, script: dict[str, tuple[str, list[str]]]):
        self.script = script
        self.calls: list[tuple[list[str], object, object]] = []

    def generate(self, prompts, params, seed=None):
        self.calls.append((list(prompts), params, seed))
        texts = []
        for prompt in prompts:
            (question,) = [q for q in self.script if q in prompt]
            greedy, sampled = self.script[question]
            texts.extend([greedy] if params.greedy else sampled[:params.n])
        n = len(texts)
        zeros, ones = torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long)
        return Generation(prompt_ids=zeros, prompt_mask=ones, completion_ids=zeros, completion_mask=ones,
                          truncated=torch.tensor(["TRUNC" in t for t in texts]), completions=texts)


def test_pass_at_k_hand_values():
    # n=5 samples, c=2 correct, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    # n == k: any-of-k.
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    # k=1 is the plain sample accuracy c/n.
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def scripted_set():
    examples = [example("Q-alpha", "12", 0), example("Q-beta", "1080", 1), example("Q-gamma", "7", 2),
                example("Q-delta", "5", 3)]
    script = {
        # correct and formatted; samples 1 of 3 correct
        "Q-alpha": (GOOD.format(12), [GOOD.format(12), GOOD.format(13), "no tags"]),
        # correct ("1,080" == "1080") but not formatted (no think block); samples all wrong
        "Q-beta": ("<answer>1,080</answer>", [GOOD.format(1), GOOD.format(2), GOOD.format(3)]),
        # formatted but wrong; samples 3 of 3 correct
        "Q-gamma": (GOOD.format(8), [GOOD.format(7), GOOD.format("7.0"), GOOD.format(7)]),
        # neither, and truncated; samples 2 of 3 correct
        "Q-delta": ("I think 5 TRUNC", [GOOD.format(5), "<answer>5</answer>", GOOD.format(6)]),
    }
    return examples, script


def test_evaluate_exact_metrics_from_known_completions(tiny_tokenizer):
    examples, script = scripted_set()
    engine = ScriptedEngine(script)
    result = evaluate(None, tiny_tokenizer, examples, engine=engine, samples=3, temperature=0.7, batch_size=6,
                      max_new_tokens=17, seed=5, progress=False, return_records=True)
    assert result["n"] == 4
    assert result["accuracy"] == 2 / 4  # alpha, beta
    assert result["format_rate"] == 2 / 4  # alpha, gamma
    assert result["truncated_rate"] == 1 / 4  # delta
    assert result["pass@3"] == 3 / 4  # alpha, gamma, delta have a correct sample
    assert result["mean_sample_accuracy"] == result["mean@3"] == (1 + 0 + 3 + 2) / 12
    # unbiased pass@1 = mean of c/3; pass@2 = 1 - C(3-c, 2)/C(3, 2): alpha 2/3, beta 0, gamma 1, delta 1
    assert result["pass@1"] == pytest.approx((1 / 3 + 0 + 1 + 2 / 3) / 4)
    assert result["pass@2"] == pytest.approx((2 / 3 + 0 + 1 + 1) / 4)
    # majorities: alpha 12 (1 vote each of 12, 13: the first seen), beta 1 (tie: first), gamma 7 (3 votes),
    # delta 5 (2 votes): correct for alpha, gamma, delta
    assert result["maj@3"] == 3 / 4
    assert result["sample_format_rate"] == 10 / 12  # all but "no tags" and the bare "<answer>5</answer>"
    assert [r["correct"] for r in result["records"]] == [True, True, False, False]
    assert [r["sample_correct"] for r in result["records"]] == [1, 0, 3, 2]
    assert result["records"][1]["prediction"] == "1,080"

    greedy_calls = [c for c in engine.calls if c[1].greedy]
    sample_calls = [c for c in engine.calls if not c[1].greedy]
    # batch_size 6 completions per call: greedy 6 prompts/call -> one call; k=3 -> 2 prompts/call -> two calls
    assert [len(c[0]) for c in greedy_calls] == [4]
    assert [len(c[0]) for c in sample_calls] == [2, 2]
    assert all(c[1].max_tokens == 17 for c in engine.calls)
    assert all(c[1].n == 3 and c[1].temperature == 0.7 for c in sample_calls)
    assert [c[2] for c in sample_calls] == [5, 6]  # one seed per call
    # The default system prompt of the tag style is in every rendered prompt.
    assert all(get_tag_style("think").system_prompt in p for c in engine.calls for p in c[0])


def test_evaluate_reasoning_tags_and_custom_system_prompt(tiny_tokenizer):
    examples = [example("Q-one", "3", 0), example("Q-two", "4", 1)]
    script = {"Q-one": ("<reasoning>r</reasoning><answer>3</answer>", []),
              "Q-two": (GOOD.format(4), [])}  # think tags: answer read, but not the reasoning format
    engine = ScriptedEngine(script)
    result = evaluate(None, tiny_tokenizer, examples, engine=engine, tag_style="reasoning",
                      system_prompt="SYSTEM-XYZ", progress=False)
    assert result["accuracy"] == 1.0
    assert result["format_rate"] == 0.5
    assert "pass@1" not in result and "mean_sample_accuracy" not in result and "records" not in result
    assert all("SYSTEM-XYZ" in p for p in engine.calls[0][0])


def test_evaluate_refuses_bad_input(tiny_tokenizer):
    engine = ScriptedEngine({})
    with pytest.raises(ValueError, match="no gold answer"):
        evaluate(None, tiny_tokenizer, [example("Q", None, 0)], engine=engine, progress=False)
    with pytest.raises(ValueError, match="temperature"):
        evaluate(None, tiny_tokenizer, [example("Q", "1", 0)], engine=engine, samples=2, temperature=0,
                 progress=False)
    with pytest.raises(ValueError, match="unknown tag style"):
        evaluate(None, tiny_tokenizer, [example("Q", "1", 0)], engine=engine, tag_style="xml", progress=False)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    from grpo.models.tiny import build_qwen2

    folder = tmp_path_factory.mktemp("tiny-model")
    build_qwen2(tiny_tokenizer, seed=3).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_evaluate_real_tiny_model_restores_rng(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    examples = [example(f"What is {i} + {i}?", str(2 * i), i) for i in range(3)]
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    result = evaluate(model, tiny_tokenizer, examples, max_new_tokens=6, samples=2, batch_size=4, progress=False,
                      return_records=True)
    assert torch.rand(1) == expected_next  # sampling with seed=0 did not move the caller's RNG stream
    assert result["n"] == 3
    for key in ("accuracy", "format_rate", "pass@2", "mean_sample_accuracy"):
        assert 0.0 <= result[key] <= 1.0
    assert result["pass@2"] >= result["mean_sample_accuracy"]
    assert all(len(r["sample_completions"]) == 2 for r in result["records"])
    # The sampled completions depend only on the seed.
    again = evaluate(model, tiny_tokenizer, examples, max_new_tokens=6, samples=2, batch_size=4, progress=False,
                     return_records=True)
    assert [r["sample_completions"] for r in again["records"]] == [r["sample_completions"] for r in result["records"]]


def test_run_eval_command_writes_report(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    write_gsm8k_jsonl([example(f"What is {i} + 1?", str(i + 1), i) for i in range(5)], data)
    report_path = tmp_path / "out" / "report.json"
    records_path = tmp_path / "out" / "records.jsonl"
    report = run_eval_command(tiny_model_dir, str(data), limit=4, samples=2, output=report_path,
                              records_output=records_path, batch_size=8, max_new_tokens=5, device="cpu",
                              progress=False)
    written = json.loads(report_path.read_text())
    assert written == report
    for key in ("accuracy", "format_rate", "n", "pass@2", "mean_sample_accuracy", "model", "data", "split"):
        assert key in written
    assert written["n"] == 4 and written["data"] == str(data) and written["split"] == "test"
    assert written["model"] == str(tiny_model_dir)
    assert written["system_prompt"] == get_tag_style("think").system_prompt
    lines = records_path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["gold"] == "1"
    assert "accuracy" in capsys.readouterr().out  # the printed table


def test_run_eval_command_needs_data_without_run_config(tiny_model_dir):
    from grpo.config import ConfigError

    with pytest.raises(ConfigError, match="no data given"):
        run_eval_command(tiny_model_dir, None, device="cpu", progress=False)


def test_run_eval_command_named_sets_task_rewards_and_bootstrap(tiny_model_dir, tmp_path):
    records_path = tmp_path / "records.jsonl"
    report = run_eval_command(tiny_model_dir, ["easy=kk:seed=5,n=6,people=2", "logic=kk:seed=2,n=4,people=2-3"],
                              task="kk", rewards=["kk_logic"], samples=2, temperature=1.0, bootstrap=50,
                              records_output=records_path, batch_size=8, max_new_tokens=4, device="cpu",
                              progress=False, max_samples_written=1)
    assert report["task"] == "kk" and report["rewards"] == ["kk_logic"]
    assert set(report["sets"]) == {"easy", "logic"} and "accuracy" not in report  # no unnamed set
    metrics = report["metrics"]
    for name in ("easy", "logic"):  # the names a run logs
        for key in ("accuracy", "format_rate", "pass@1", "pass@2", "maj@2", "reward/kk_logic", "reward/total",
                    "accuracy_ci_low", "accuracy_ci_high", "per_person_accuracy"):
            assert f"eval/{name}/{key}" in metrics, (name, key)
    assert any(k.startswith("eval/logic/accuracy/people=") for k in metrics)
    assert report["system_prompt"] == resolve_task("kk").system_prompt("think")  # the task's, no run config
    for name, n in (("easy", 6), ("logic", 4)):
        rows = [json.loads(line) for line in (tmp_path / f"records-{name}.jsonl").read_text().splitlines()]
        assert len(rows) == n and all(len(r["sample_completions"]) == 1 and "kk_logic" in r["rewards"] for r in rows)
    assert not records_path.exists()


def test_run_eval_command_of_a_run_folder_uses_its_task_sets_and_rewards(tiny_model_dir, tmp_path):
    from grpo.config import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    dump_config(load_config(None, [f"model.name_or_path={tiny_model_dir}", "data.train=kk:seed=1,n=8",
                                   "data.eval={a: 'kk:seed=3,n=3', b: 'kk:seed=4,n=2'}", "rewards=[kk_logic]"]),
                run / "config.yaml")
    import shutil

    shutil.copytree(tiny_model_dir, run / "final")
    report = run_eval_command(run, max_new_tokens=4, device="cpu", progress=False, batch_size=4)
    assert report["task"] == "kk" and report["rewards"] == ["kk_logic"]  # data.task by data.train; the run's rewards
    assert report["data"] == {"a": "kk:seed=3,n=3", "b": "kk:seed=4,n=2"}
    assert report["sets"]["a"]["n"] == 3 and report["sets"]["b"]["n"] == 2
    assert "eval/a/reward/kk_logic" in report["metrics"]
    assert run_eval_command(run, max_new_tokens=4, device="cpu", progress=False, rewards=[])["rewards"] == []
