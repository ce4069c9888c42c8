"""reasoning-gym as a data source, task and reward (grpo.data.reasoning_gym, grpo.tasks.reasoning_gym_task): the
spec grammar, items of several datasets and a composite scored by their own score_answer through grpo's answer
tags, per-dataset accuracy in evaluation, the Python API's dataset objects, and the failure cases (unknown
dataset or option, malformed spec, missing package)."""

from __future__ import annotations

import sys

import pytest

from grpo.config import load_config
from grpo.data import DataError, load_dataset_source
from grpo.data.reasoning_gym import DatasetPart, parse_gold, parse_spec, parse_value
from grpo.rewards.registry import get_reward_function
from grpo.tasks import resolve_task
from grpo.evaluation.example_records import example_records, logged_metrics, summarize

SMALL_SUMS = "chain_sum,min_terms=2,max_terms=2,max_digits=1"
# datasets with numeric, text and list answers; leg_counting and spell_backward score text, not numbers
DATASETS = [SMALL_SUMS, "basic_arithmetic,max_digits=2", "leg_counting", "spell_backward", "word_sorting"]
COMPOSITE = "reasoning_gym:chain_sum*3,max_digits=1+leg_counting+spell_backward,size=40,seed=5"


def tagged(answer: str) -> str:
    return f"<think>\nworking\n</think>\n<answer>\n{answer}\n</answer>"


def test_spec_parts_weights_source_keys_and_values():
    spec = parse_spec("s", "chain_sum*3,max_digits=1,seed=4+basic_arithmetic,operators=+|-,size=12")
    assert spec.size == 12 and spec.seed == 4
    assert spec.parts == (DatasetPart("chain_sum", 3.0, {"max_digits": 1}),
                          DatasetPart("basic_arithmetic", 1.0, {"operators": ("+", "-")}))
    assert parse_spec("s", "leg_counting").parts == (DatasetPart("leg_counting"),)
    assert parse_spec("s", "leg_counting").size == 500 and parse_spec("s", "leg_counting").seed == 0
    assert [parse_value(v) for v in ("3", "0.5", "TRUE", "false", "none", "abc", "1|x")] == [
        3, 0.5, True, False, None, "abc", (1, "x")]


@pytest.mark.parametrize("text, message", [
    ("size=3", "starts with a reasoning-gym dataset name"),
    ("chain_sum,max_digits", "expected key=value"),
    ("chain_sum,seed=1,seed=2", "key 'seed' given twice"),
    ("chain_sum,size=many", "size must be an integer"),
    ("chain_sum,size=0", "size must be at least 1"),
    ("chain_sum*0+leg_counting", "weight must be positive"),
    ("chain_sum*x+leg_counting", "weight must be a number"),
])
def test_malformed_specs_say_what_is_wrong(text, message):
    with pytest.raises(DataError, match=message):
        load_dataset_source(f"reasoning_gym:{text}")


@pytest.mark.parametrize("options", DATASETS)
def test_items_are_scored_by_their_dataset_through_the_answer_tags(options):
    source = f"reasoning_gym:{options},size=6,seed=3"
    examples = load_dataset_source(source)
    assert load_dataset_source(source) == examples  # one seed, one set of problems (every rank the same)
    assert load_dataset_source(source, limit=2) == examples[:2]
    task = resolve_task(None, source)
    name = options.split(",")[0]
    assert task.name == "reasoning_gym"
    for index, example in enumerate(examples):
        assert example.source == f"{source}#{index}" and example.messages[0]["role"] == "user"
        assert task.group_of(example) == name
        right = task.score(tagged(example.answer_raw), example.answer, "think")
        assert right == {"prediction": example.answer_raw.strip(), "correct": True, "formatted": True}
        wrong = task.score(tagged("certainly not this"), example.answer, "think")
        assert wrong["correct"] is False and wrong["formatted"] is True
        untagged = task.score(example.answer_raw, example.answer, "think")  # the answer outside the tags
        assert untagged["prediction"] is None and untagged["correct"] is False


def test_the_gold_keeps_the_entry_score_answer_reads():
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("chain_sum", size=3, seed=9, max_digits=1)
    examples = load_dataset_source("reasoning_gym:chain_sum,size=3,seed=9,max_digits=1")
    for entry, example in zip(dataset, examples, strict=True):
        assert parse_gold(example.answer) == {"answer": entry["answer"], "metadata": entry["metadata"]}
        assert example.question == entry["question"] and example.answer_raw == entry["answer"]
    with pytest.raises(ValueError, match="is not a reasoning-gym entry"):
        parse_gold("42")


def test_a_composite_mixes_its_datasets_by_weight_and_scores_each_by_its_own():
    examples = load_dataset_source(COMPOSITE)
    task = resolve_task(None, COMPOSITE)
    groups = [task.group_of(e) for e in examples]
    assert set(groups) == {"chain_sum", "leg_counting", "spell_backward"}
    assert groups.count("chain_sum") > groups.count("leg_counting")  # weight 3 against 1 over 40 items
    assert all(task.score(tagged(e.answer_raw), e.answer, "think")["correct"] for e in examples)
    # each sub-dataset's options are its own: chain_sum's max_digits=1 keeps its terms to one digit
    sums = [parse_gold(e.answer)["metadata"] for e in examples if task.group_of(e) == "chain_sum"]
    assert all(m["num_digits"] == 1 for m in sums)


def test_the_reward_takes_trls_call_and_logs_each_datasets_mean():
    examples = load_dataset_source(COMPOSITE)[:6]
    reward = get_reward_function("reasoning_gym", tag_style="think")
    completions = [tagged(e.answer_raw) for e in examples[:3]] + [tagged("nope"), "no tags", [
        {"role": "assistant", "content": tagged(examples[5].answer_raw)}]]
    logged = {}
    values = reward(prompts=[e.messages for e in examples], completions=completions,
                    answer=[e.answer for e in examples], log_metric=logged.__setitem__)
    assert values[:3] == [1.0, 1.0, 1.0] and values[4] == 0.0 and values[5] == 1.0
    assert 0.0 <= values[3] < 1.0
    groups = [parse_gold(e.answer)["metadata"]["source_dataset"] for e in examples]
    for name in set(groups):
        mine = [v for v, g in zip(values, groups) if g == name]
        assert logged[f"reasoning_gym/{name}"] == pytest.approx(sum(mine) / len(mine))
    with pytest.raises(ValueError, match="needs the dataset column 'answer'"):
        reward(prompts=["p"], completions=["c"], question=["q"])


def test_evaluation_reports_accuracy_per_dataset():
    examples = load_dataset_source(COMPOSITE)[:12]
    task = resolve_task(None, COMPOSITE)
    # right on the chain sums only: their accuracy is 1, the others' 0, the set's their share
    texts = [tagged(e.answer_raw) if task.group_of(e) == "chain_sum" else tagged("?") for e in examples]
    records = example_records(task, examples, "think", texts, [False] * len(texts), [], 1)
    metrics = logged_metrics({"mix": summarize(records)})
    share = sum(task.group_of(e) == "chain_sum" for e in examples) / len(examples)
    assert metrics["eval/mix/accuracy"] == pytest.approx(share)
    assert metrics["eval/mix/accuracy/chain_sum"] == 1.0
    assert metrics["eval/mix/accuracy/leg_counting"] == 0.0 and metrics["eval/mix/accuracy/spell_backward"] == 0.0
    assert 0.0 <= metrics["eval/mix/score"] <= 1.0  # the datasets' own scores, partial credit included


def test_a_recipe_on_reasoning_gym_gets_its_rewards_and_named_eval_sets(tmp_path):
    recipe = tmp_path / "rg.yaml"
    recipe.write_text(f"data:\n  train: {COMPOSITE}\n  eval:\n    sums: reasoning_gym:{SMALL_SUMS},size=8,seed=2\n"
                      f"    legs: reasoning_gym:leg_counting,size=8,seed=2\n")
    cfg = load_config(recipe)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("reasoning_gym", 1.0), ("format_think_answer", 0.1)]
    assert resolve_task(cfg.data.task, cfg.data.train).name == "reasoning_gym"
    assert resolve_task("reasoning_gym").system_prompt("think").endswith(
        "give only the final answer inside <answer> tags.")


def test_unknown_dataset_lists_the_known_ones_and_unknown_option_the_datasets():
    with pytest.raises(DataError, match=r"unknown reasoning-gym dataset 'chain_summ'; known: \[.*'chain_sum'"):
        load_dataset_source("reasoning_gym:chain_summ,size=3")
    with pytest.raises(DataError, match=r"chain_sum has no option\(s\) \['digits'\]; its options: \[.*'max_digits'"):
        load_dataset_source("reasoning_gym:chain_sum,digits=3")
    with pytest.raises(DataError, match="reasoning-gym refused the options"):  # its config's own check
        load_dataset_source("reasoning_gym:chain_sum,min_terms=5,max_terms=2")


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now fails
    with pytest.raises(DataError, match=r"reasoning-gym is not installed: pip install 'grpo\[envs\]'"):
        load_dataset_source("reasoning_gym:chain_sum,size=3")
    import grpo.rewards.reasoning_gym_score as task_module

    monkeypatch.setattr(task_module, "score_function", task_module.score_function.__wrapped__)  # no cached scorer
    gold = "{'answer': '3', 'metadata': {'source_dataset': 'chain_sum'}}"
    with pytest.raises(DataError, match=r"pip install 'grpo\[envs\]'"):
        get_reward_function("reasoning_gym")(prompts=["p"], completions=[tagged("3")], answer=[gold])


def test_the_python_api_takes_a_dataset_object():
    import reasoning_gym

    from grpo.api.datasets import to_examples
    from grpo.data.reasoning_gym import is_reasoning_gym_dataset

    dataset = reasoning_gym.create_dataset("leg_counting", size=5, seed=1)
    assert is_reasoning_gym_dataset(dataset) and not is_reasoning_gym_dataset([{"prompt": "x"}])
    examples = to_examples(dataset, "train_dataset")
    assert [e.question for e in examples] == [entry["question"] for entry in dataset]
    from_spec = load_dataset_source("reasoning_gym:leg_counting,size=5,seed=1")
    assert [(e.messages, e.answer) for e in examples] == [(e.messages, e.answer) for e in from_spec]
    assert examples[0].source == "train_dataset#0"
    assert to_examples(dataset, "train_dataset", limit=2) == examples[:2]
    assert resolve_task("reasoning_gym").score(tagged(examples[0].answer_raw), examples[0].answer, "think")["correct"]
