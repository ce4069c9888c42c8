"""Evaluation scored by the run's task and rewards, from known completions (scripted engines): K&K accuracy by
number of people and per-person accuracy, reward means, the logged names of named sets, slices of a set that
give the whole set's records (what ranks evaluate), bootstrap intervals, ``--data`` parsing, the best metric
and the eval config keys."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.data import Example, load_dataset_source
from grpo.run.best import BestMetric
from grpo.rollout.generation import Generation
from grpo.tasks import resolve_task
from grpo.commands.eval_command import parse_data_sets
from grpo.evaluation.example_records import EvalRewards, logged_metrics, summarize
from grpo.evaluation.evaluate import call_unit, evaluate, evaluate_records
from grpo.training.evaluator import eval_sources, primary_metric, rank_example_range

TAGGED = "<think>\nwork\n</think>\n<answer>\n{}\n</answer>"


def generation(texts: list[str]) -> Generation:
    n = len(texts)
    zeros, ones = torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long)
    return Generation(prompt_ids=zeros, prompt_mask=ones, completion_ids=zeros, completion_mask=ones,
                      truncated=torch.zeros(n, dtype=torch.bool), completions=texts)


class KeyedEngine:
    """Greedy: ``answers[key]`` for the prompt holding ``key``; sampled: the same answer n times."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers

    def generate(self, prompts, params, seed=None):
        texts = []
        for prompt in prompts:
            (key,) = [k for k in self.answers if k in prompt]
            texts.extend([self.answers[key]] * params.n)
        return generation(texts)


def kk_set():
    # 3 puzzles: Grace/Joseph/Riley (3 people), Mason/Joseph/Oliver (3), Harper/Michael (2); golds in comments
    examples = load_dataset_source("kk:seed=3,n=3,people=2-3")
    assert [len(e.answer.splitlines()) for e in examples] == [3, 3, 2]
    answers = {
        # right: all three knights
        "Grace, Joseph": TAGGED.format("(1) Grace is a knight\n(2) Joseph is a knight\n(3) Riley is a knight"),
        # gold Mason knave, Joseph knight, Oliver knight: Mason wrong, the other two right -> 2/3 per person
        "Mason, Joseph": TAGGED.format("(1) Mason is a knight\n(2) Joseph is a knight\n(3) Oliver is a knight"),
        # right (Harper knight, Michael knave), but without the think block: right answer, bad format
        "Harper, and Michael": "<answer>\n(1) Harper is a knight\n(2) Michael is a knave\n</answer>",
    }
    return examples, KeyedEngine(answers)


def test_kk_evaluation_scores_with_the_task(tiny_tokenizer):
    examples, engine = kk_set()
    kk = resolve_task("kk")
    result = evaluate(None, tiny_tokenizer, examples, task=kk, engine=engine, progress=False,
                      system_prompt=kk.system_prompt("think"))
    assert result["accuracy"] == 2 / 3
    assert result["accuracy/people=3"] == 1 / 2 and result["accuracy/people=2"] == 1.0
    assert result["per_person_accuracy"] == pytest.approx((1 + 2 / 3 + 1) / 3)
    assert result["format_rate"] == 2 / 3
    # The gsm8k default reads "(1) Grace is a knight" as the number 1: every answer wrong.
    assert evaluate(None, tiny_tokenizer, examples, engine=engine, progress=False)["accuracy"] == 0.0


def test_kk_majority_vote_uses_the_task_answers(tiny_tokenizer):
    examples, engine = kk_set()
    result = evaluate(None, tiny_tokenizer, examples, task=resolve_task("kk"), engine=engine, samples=4,
                      temperature=1.0, progress=False, return_records=True, max_written=1)
    assert result["maj@4"] == 2 / 3 and result["pass@4"] == 2 / 3 and result["mean@4"] == 2 / 3
    assert [len(r["sample_completions"]) for r in result["records"]] == [1, 1, 1]
    assert result["records"][0]["majority"] == "(1) Grace is a knight\n(2) Joseph is a knight\n(3) Riley is a knight"


def numbers(prompts, completions, answer, **kwargs):
    """1 when the completion's text holds the gold answer, else 0 (a chat completion, as training passes)."""
    return [float(gold in c[0]["content"]) for c, gold in zip(completions, answer)]


def odd_only(prompts, completions, answer, **kwargs):
    """Abstains (None) on even golds, 2.0 on odd ones."""
    return [2.0 if int(gold) % 2 else None for gold in answer]


def numeric_examples(n: int) -> list[Example]:
    return [Example(messages=[{"role": "user", "content": f"Q{i}: what is {i}?"}], answer=str(i), answer_raw=str(i),
                    source=f"test:{i}", solution=None) for i in range(n)]


def test_rewards_means_over_greedy_completions(tiny_tokenizer):
    examples = numeric_examples(4)
    engine = KeyedEngine({f"Q{i}:": TAGGED.format(i if i < 3 else 99) for i in range(4)})
    rewards = EvalRewards([numbers, odd_only], [1.0, 0.5])
    result = evaluate(None, tiny_tokenizer, examples, engine=engine, rewards=rewards, progress=False,
                      return_records=True)
    assert result["reward/numbers"] == 3 / 4
    assert result["reward/odd_only"] == 2.0  # the mean where it did not abstain (golds 1 and 3)
    # totals: gold 0: 1, gold 1: 1 + 0.5 * 2, gold 2: 1, gold 3 (wrong): 0 + 0.5 * 2
    assert result["reward/total"] == (1 + 2 + 1 + 1) / 4
    assert result["records"][0]["rewards"] == {"numbers": 1.0, "odd_only": None, "total": 1.0}


def test_named_sets_logged_names():
    one = {"n": 3, "accuracy": 0.5, "format_rate": 1.0, "pass@2": 0.75, "accuracy/people=3": 0.25}
    assert logged_metrics({"": one}) == {"eval/accuracy": 0.5, "eval/format_rate": 1.0, "eval/pass@2": 0.75,
                                         "eval/accuracy/people=3": 0.25}
    named = logged_metrics({"gsm8k": one, "hard": {"n": 1, "accuracy": 0.0}})
    assert named["eval/gsm8k/accuracy"] == 0.5 and named["eval/hard/accuracy"] == 0.0
    assert "eval/accuracy" not in named and "eval/gsm8k/n" not in named
    assert eval_sources("synthetic:seed=1,n=4") == {"": "synthetic:seed=1,n=4"}
    assert eval_sources({"a": "x", "b": "y"}) == {"a": "x", "b": "y"} and eval_sources(None) == {}
    # early stopping (and the before/after report) read the first set
    assert primary_metric({"": "x"}) == "eval/accuracy" and primary_metric({"b": "y", "a": "x"}) == "eval/b/accuracy"


class SeededEngine:
    """Sampled completion j of a prompt: right when (seed + j + the prompt's place in its call) % 5 is 0 or 2, so a
    call's samples depend on its seed and its prompts: slices give the whole set's records only when their
    calls are the whole set's."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, seed=None):
        self.calls.append(len(prompts))
        texts = []
        for place, prompt in enumerate(prompts):
            gold = prompt.split("what is ")[1].split("?")[0]
            for j in range(params.n):
                right = params.greedy or (seed + j + place) % 5 in (0, 2)
                texts.append(TAGGED.format(gold if right else "x"))
        return generation(texts)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rank_example_ranges_give_the_whole_sets_records(tiny_tokenizer, world_size):
    examples = numeric_examples(23)
    settings = dict(engine=SeededEngine(), batch_size=6, samples=4, temperature=1.0, seed=7, progress=False)
    whole, _ = evaluate_records(None, tiny_tokenizer, examples, **settings)
    unit = call_unit(6, 4)
    assert unit == 6  # greedy: 6 prompts per call; 4 samples: 1 prompt per call
    slices = [rank_example_range(len(examples), unit, rank, world_size) for rank in range(world_size)]
    assert slices[0][0] == 0 and slices[-1][1] == 23
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))  # contiguous, covering the set
    parts = []
    for start, end in slices:
        records, _ = evaluate_records(None, tiny_tokenizer, examples[start:end], first_example=start, **settings)
        parts.extend(records)
    assert parts == whole
    assert 0 < summarize(whole, 4)["mean@4"] < 1  # the seeds matter
    with pytest.raises(ValueError, match="multiple of 6"):
        evaluate_records(None, tiny_tokenizer, examples[3:], first_example=3, **settings)


def test_bootstrap_interval_of_accuracy():
    records = [{"correct": i % 4 != 0, "formatted": True, "truncated": False} for i in range(40)]
    metrics = summarize(records, bootstrap=200, seed=1)
    assert metrics["accuracy"] == 0.75
    assert metrics["accuracy_ci_low"] < 0.75 < metrics["accuracy_ci_high"]
    assert summarize(records, bootstrap=200, seed=1) == metrics  # deterministic for a seed
    assert "accuracy_ci_low" not in summarize(records)


def test_parse_data_sets():
    assert parse_data_sets("synthetic:seed=1,n=5") == {"": "synthetic:seed=1,n=5"}
    assert parse_data_sets(["a=synthetic:seed=1,n=5", "b=data/test.jsonl"]) == {
        "a": "synthetic:seed=1,n=5", "b": "data/test.jsonl"}
    assert parse_data_sets(["prompts:path=x.jsonl"]) == {"": "prompts:path=x.jsonl"}
    with pytest.raises(ConfigError, match="name every set"):
        parse_data_sets(["a=x", "y"])
    with pytest.raises(ConfigError, match="given twice"):
        parse_data_sets(["a=x", "a=y"])


def test_best_metric_improves_by_mode(tmp_path):
    best = BestMetric("eval/accuracy", "max")
    assert best.update(0, {"eval/accuracy": 0.2})
    assert not best.update(1, {"eval/accuracy": 0.2})  # a tie keeps the earlier step
    assert best.update(2, {"eval/accuracy": 0.3}) and (best.step, best.value) == (2, 0.3)
    assert not best.update(3, {"eval/accuracy": float("nan")})
    low = BestMetric("eval/truncated_rate", "min", value=0.5, step=1)
    assert low.update(4, {"eval/truncated_rate": 0.4}) and not low.update(5, {"eval/truncated_rate": 0.45})
    with pytest.raises(ConfigError, match="train.best_metric.*eval/acuracy.*eval/accuracy"):
        BestMetric("eval/acuracy").update(0, {"eval/accuracy": 0.1})
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text('{"step": 6, "metric": "eval/accuracy", "value": 0.5}')
    assert BestMetric.resumed(tmp_path, "eval/accuracy", "max") == BestMetric("eval/accuracy", "max", 0.5, 6)
    assert BestMetric.resumed(tmp_path, "eval/pass@4", "max").value is None  # another metric starts over


def test_eval_config_keys():
    cfg = load_config(None, ["data.eval={gsm8k: 'synthetic:seed=1,n=5', hard: 'synthetic:seed=2,n=5,steps=3'}",
                             "eval.num_samples=4", "eval.bootstrap=100", "train.best_metric=eval/gsm8k/pass@4"])
    assert cfg.data.eval == {"gsm8k": "synthetic:seed=1,n=5", "hard": "synthetic:seed=2,n=5,steps=3"}
    assert (cfg.eval.num_samples, cfg.eval.bootstrap, cfg.train.best_metric_mode) == (4, 100, "max")
    for overrides, message in [
        (["data.eval={a: 3}"], "data.eval: expected str or mapping of str to str"),
        (["data.eval={'a/b': x}"], "data.eval has set name"),
        (["train.best_metric=eval/accuracy"], "train.best_metric needs data.eval"),
        (["data.eval=x", "train.best_metric=accuracy"], "train.best_metric is 'accuracy'"),
        (["eval.temperature=0"], "eval.temperature"),
        (["data.eval={a: 'synthetic:seed=1,n=5', b: 'kk:seed=1,n=5'}"], "data.eval.b is kk:seed=1,n=5, which gives "
                                                                       "Knights-and-Knaves solutions"),
        (["train.best_metric_mode=up"], "train.best_metric_mode"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_run_evaluator_refuses_sets_it_cannot_score_before_any_rank_starts():
    from grpo.parallel.distributed import DistInfo
    from grpo.training.evaluator import RunEvaluator, eval_settings

    from grpo.tasks import run_task

    cfg = load_config(None, ["data.eval=x"])
    settings = eval_settings(cfg, run_task(cfg))
    unanswered = numeric_examples(3)
    unanswered[2] = Example(messages=[{"role": "user", "content": "Q"}], answer=None, answer_raw=None,
                            source="test:open", solution=None)
    info = DistInfo(rank=0, world_size=1, local_rank=0)
    with pytest.raises(ConfigError, match="data.eval set 'hard': 1 example.*test:open"):
        RunEvaluator(settings, {"easy": numeric_examples(2), "hard": unanswered}, None, None, None, info)
    with pytest.raises(ConfigError, match="data.eval: no examples"):
        RunEvaluator(settings, {"": []}, None, None, None, info)
