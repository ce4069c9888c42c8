"""grpo.api.datasets and grpo.api.rewards: TRL's datasets and reward_funcs as grpo's records and functions."""

from __future__ import annotations

import functools

import pytest

from grpo.api.datasets import to_examples
from grpo.api.rewards import build_reward_functions, reward_name
from grpo.data import DataError, build_prompt_messages, render_example

SYSTEM = "Answer in <answer> tags."


def chat_rows():
    return [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{i} + 1?"}],
             "answer": f"{i + 1:,}0", "id": i} for i in range(3)]


def test_chat_prompts_keep_their_system_turn_and_columns_reach_rewards_verbatim():
    examples = to_examples(chat_rows(), "train_dataset")
    e = examples[2]
    assert e.system == SYSTEM and e.messages == [{"role": "user", "content": "2 + 1?"}]
    assert e.columns() == {"answer": "30", "id": 2}  # as in the row (TRL passes columns as they are)
    assert e.answer == "30" and e.source == "train_dataset[2]"
    assert build_prompt_messages(e, "the run's own")[0] == {"role": "system", "content": SYSTEM}
    assert to_examples(chat_rows(), "train_dataset", pass_columns=False)[0].columns() == {}  # remove_unused_columns


def test_text_prompts_are_used_as_written(tiny_tokenizer):
    examples = to_examples([{"prompt": "Q: 2+2?\nA:", "answer": "4"}], "train_dataset")
    assert examples[0].plain_text and render_example(tiny_tokenizer, examples[0], "ignored") == "Q: 2+2?\nA:"


def test_a_datasets_dataset_and_an_iterable_one():
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(chat_rows())
    assert [e.columns()["id"] for e in to_examples(dataset, "train_dataset")] == [0, 1, 2]
    iterable = datasets.IterableDataset.from_generator(lambda: iter(chat_rows()))
    assert len(to_examples(iterable, "train_dataset", limit=2)) == 2
    with pytest.raises(ValueError, match="IterableDataset: set max_steps > 0"):
        to_examples(iterable, "train_dataset")


@pytest.mark.parametrize("rows, match", [
    ([{"question": "x"}], r"train_dataset\[0\]: no 'prompt' column \(its columns: \['question'\]\)"),
    ([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}], r"train_dataset\[1\]: 'prompt' is chat"),
    ([{"prompt": [{"role": "tool", "content": "b"}]}], r"train_dataset\[0\]: message 0 has role 'tool'"),
    ([], "train_dataset has no rows"),
])
def test_bad_rows_are_errors_naming_the_row(rows, match):
    with pytest.raises((DataError, ValueError), match=match):
        to_examples(rows, "train_dataset")


class Judge:
    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)

    def method(self, completions, **kwargs):
        return [1.0] * len(completions)


def base(completions, scale=1.0, **kwargs):
    return [scale] * len(completions)


async def judged(completions, **kwargs):
    return [0.5] * len(completions)


def test_rewards_are_named_as_trl_names_them():
    judge = Judge()
    fns = [base, functools.partial(base, scale=2.0), lambda completions, **kw: [0.0] * len(completions), judge,
           judge.method, judged]
    assert [reward_name(f) for f in fns] == ["base", "base", "<lambda>", "Judge", "method", "judged"]
    built, weights = build_reward_functions(fns, None, None, ["answer"])
    assert [f.name for f in built] == ["base", "base_2", "<lambda>", "Judge", "method", "judged"]
    assert weights == [1.0] * 6 and built[-1].is_async
    assert reward_name("org/reward-model") == "reward-model"


def test_reward_errors_name_the_reward():
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"reward 'needs_solution' cannot be called with the keywords"):
        build_reward_functions([needs_solution], None, None, ["answer"])
    with pytest.raises(ValueError, match="reward_weights has 1 weights for 2 reward_funcs"):
        build_reward_functions([base, base], [1.0], None, [])
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries for 1 reward_funcs"):
        build_reward_functions([base], None, [None, None], [])
    with pytest.raises(ValueError, match="neither a local reward model folder nor a hub id"):
        build_reward_functions(["./no/such/model"], None, None, [])
    with pytest.raises(TypeError, match="is not a callable"):
        build_reward_functions([42], None, None, [])


def test_a_loaded_reward_model_scores_prompt_and_completion(tiny_tokenizer):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tiny_tokenizer.pad_token_id)
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    judge = Qwen2ForSequenceClassification(config)
    judge.config._name_or_path = "org/tiny-judge"
    (fn,), _ = build_reward_functions([judge], None, [tiny_tokenizer], [])
    assert fn.name == "tiny-judge"
    prompts = [[{"role": "user", "content": "1 + 1?"}]] * 2
    completions = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "three"}]]
    scores = fn(prompts, completions)
    assert len(scores) == 2 and scores[0] != scores[1]


def test_a_callers_tokenizer_is_not_changed(tiny_tokenizer):
    import copy

    from grpo.config import load_config
    from grpo.training.inputs import GivenInputs, tokenizer_and_data

    mine = copy.deepcopy(tiny_tokenizer)
    mine.padding_side = "right"
    inputs = tokenizer_and_data(load_config(None), GivenInputs(tokenizer=mine, train_set=to_examples(chat_rows(), "t"),
                                                               reward_fns=[base]))
    assert inputs.tokenizer.padding_side == "left" and mine.padding_side == "right"
