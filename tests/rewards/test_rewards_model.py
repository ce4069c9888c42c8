"""Reward model: a tiny Qwen2 sequence classifier with an in-process tokenizer, saved and loaded by path."""

from __future__ import annotations

import pytest
import torch

from grpo.rewards import RewardSpec, build_reward_functions, get_reward_function, score

CORPUS = [
    "the answer is 42 because two plus two is four",
    "<think> some reasoning </think> <answer> 7 </answer>",
    "user assistant system what is two plus two times three",
]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

PROMPTS = ["what is two plus two? ", "q: ", "what is two times three plus four? ", "", "system: "]
COMPLETIONS = [
    "<think> two plus two </think> <answer> 4 </answer>",
    "42",
    "<think> some reasoning that is rather longer than the others, times three </think> <answer> 10 </answer>",
    "the answer is 7",
    "four",
]


def make_tokenizer(padding_side: str):
    """A byte-level BPE trained on a few sentences (no download), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|endoftext|>", padding_side=padding_side
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The same random classifier saved twice, with tokenizers that pad on the left and on the right."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    paths = {}
    torch.manual_seed(0)
    model = None
    for side in ("left", "right"):
        tokenizer = make_tokenizer(side)
        if model is None:
            config = Qwen2Config(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_labels=1,
                pad_token_id=tokenizer.pad_token_id,
                # wide init so scores are O(1) and the 1e-5 agreement checks below mean something
                initializer_range=0.5,
            )
            model = Qwen2ForSequenceClassification(config)
        path = tmp_path_factory.mktemp(f"rm_{side}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[side] = str(path)
    return paths


def reference_score(reward_fn, text: str) -> float:
    """The classifier's first logit on one unpadded text, computed directly."""
    ids = reward_fn.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return reward_fn.model(input_ids=ids).logits[0, 0].item()


def test_batched_scores_equal_one_at_a_time_and_the_direct_forward(checkpoints):
    batched = get_reward_function("model", path=checkpoints["right"], batch_size=3, device="cpu")
    single = get_reward_function("model", path=checkpoints["right"], batch_size=1, device="cpu")
    scores = batched(PROMPTS, COMPLETIONS)
    assert len(scores) == len(COMPLETIONS) and all(isinstance(s, float) for s in scores)
    assert len(set(scores)) == len(scores)  # a real model: different texts, different scores
    assert scores == pytest.approx(single(PROMPTS, COMPLETIONS), abs=1e-5)
    assert scores == pytest.approx([single([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)], abs=1e-5)
    # standard (string) samples are scored on prompt + completion, concatenated
    expected = [reference_score(batched, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_tokenizer_padding_side_does_not_change_scores(checkpoints):
    left = get_reward_function("model", path=checkpoints["left"], batch_size=5, device="cpu")
    right = get_reward_function("model", path=checkpoints["right"], batch_size=5, device="cpu")
    assert left.tokenizer.padding_side == "right"  # forced: see model.py
    assert left(PROMPTS, COMPLETIONS) == pytest.approx(right(PROMPTS, COMPLETIONS), abs=1e-5)


def test_conversational_samples_use_the_chat_template(checkpoints):
    fn = get_reward_function("model", path=checkpoints["left"], batch_size=2, device="cpu")
    prompts = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    scores = fn(prompts, completions)
    expected = [
        reference_score(fn, f"system: be brief\nuser: {p}\nassistant: {c}\n") for p, c in zip(PROMPTS, COMPLETIONS)
    ]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_model_reward_names_and_scoring(checkpoints):
    default = get_reward_function("model", path=checkpoints["right"], device="cpu")
    assert default.__name__.startswith("model_rm_right")
    assert default.per_sample_fallback is False  # a broken model fails for the batch, not per sample
    fns = build_reward_functions(
        [RewardSpec("model", weight=2.0, params={"path": checkpoints["right"], "name": "judge", "device": "cpu"})],
        tag_style="think",
    )
    result = score(fns, [2.0], PROMPTS[:2], COMPLETIONS[:2], {"answer": ["4", "42"]})
    assert result.names == ["judge"]
    torch.testing.assert_close(result.total, 2.0 * result.per_function[:, 0], rtol=0, atol=0)


def test_model_reward_rejects_bad_settings(checkpoints):
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        get_reward_function("model", path=checkpoints["right"], batch_size=0)
    with pytest.raises(ValueError, match="'float33' is not a torch dtype"):
        get_reward_function("model", path=checkpoints["right"], dtype="float33")
