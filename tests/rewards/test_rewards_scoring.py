"""Failure handling (RewardFunction) and the combination step (build_reward_functions, score)."""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grpo.rewards import RewardError, RewardFunction, RewardScores, RewardSpec, build_reward_functions, score
from grpo.rewards.context import RewardContext, make_trainer_state

GUARD_LOGGER = "grpo.rewards.reward_function"


def value_of_answer(prompts, completions, answer, **kwargs):
    """Reward = float(answer column); raises on any completion containing BOOM."""
    if any("BOOM" in c for c in completions):
        raise RuntimeError("cannot score BOOM")
    return [float(a) for a in answer]


def test_a_raising_sample_abstains_and_only_the_first_failure_is_logged(caplog):
    fn = RewardFunction(value_of_answer)
    with caplog.at_level(logging.DEBUG, logger=GUARD_LOGGER):
        # The batch call raises; per-sample calls then score the good samples with their own
        # (sliced) answer, and only the BOOM sample gets None.
        first = fn(["p0", "p1", "p2"], ["ok", "BOOM here", "ok"], answer=["1", "2", "3"])
        second = fn(["p3", "p4"], ["BOOM again", "ok"], answer=["4", "5"])
    assert first == [1.0, None, 3.0]
    assert second == [None, 5.0]
    assert fn.num_failures == 2
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1  # logged once per function; the second failure is only counted
    message = errors[0].getMessage()
    assert "value_of_answer" in message and "RuntimeError" in message
    assert "p1" in message and "BOOM here" in message  # the failing sample's excerpts
    assert errors[0].exc_info is not None  # with the traceback


def test_context_keywords_pass_through_unsliced():
    seen = []

    def reward(prompts, completions, answer, trainer_state, completion_ids, **kwargs):
        seen.append((list(answer), list(completion_ids), trainer_state.global_step))
        if len(completions) > 1:
            raise RuntimeError("only single samples")
        return [1.0]

    context = RewardContext(make_trainer_state(global_step=3, max_steps=10))
    assert RewardFunction(reward)(["a", "b"], ["x", "y"], [[1, 2], [3]], context, answer=["1", "2"]) == [1.0, 1.0]
    # the batch call, then one call per sample: columns and completion_ids sliced, the state passed as is
    assert seen == [(["1", "2"], [[1, 2], [3]], 3), (["1"], [[1, 2]], 3), (["2"], [[3]], 3)]


def test_batch_only_rewards_that_never_worked_are_a_configuration_error(caplog):
    calls = []

    def remote_like(prompts, completions, **kwargs):
        calls.append(len(completions))
        raise ConnectionError("endpoint down")

    remote_like.per_sample_fallback = False
    fn = RewardFunction(remote_like)
    with pytest.raises(RewardError, match=r"(?s)'remote_like' failed on every one of the 3 samples.*"
                                          r"ConnectionError: endpoint down.*sample prompt: a"):
        fn(["a", "b", "c"], ["x", "y", "z"])
    assert calls == [3]  # no per-sample retries


def test_batch_only_rewards_that_worked_before_abstain_for_a_failed_batch(caplog):
    up = [True]

    def remote_like(prompts, completions, **kwargs):
        if not up[0]:
            raise ConnectionError("endpoint down")
        return [1.0] * len(completions)

    remote_like.per_sample_fallback = False
    fn = RewardFunction(remote_like)
    assert fn(["a"], ["x"]) == [1.0]
    up[0] = False  # an outage after the reward has worked: the batch abstains, the run goes on
    with caplog.at_level(logging.ERROR, logger=GUARD_LOGGER):
        assert fn(["a", "b", "c"], ["x", "y", "z"]) == [None, None, None]
    assert fn.num_failures == 3
    assert len(caplog.records) == 1 and "whole batch of 3" in caplog.records[0].getMessage()


def test_a_reward_failing_on_every_sample_is_an_error_naming_it_its_error_and_a_sample():
    def positional_only(prompts, completions):  # no **kwargs: TRL's keyword call breaks it
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as caught:
        RewardFunction(positional_only)(["the prompt"], ["the completion"], [[5]], answer=["1"])
    message = str(caught.value)
    assert "'positional_only' failed on every one of the 1 samples" in message
    assert "TypeError" in message and "unexpected keyword argument" in message
    assert "**kwargs" in message  # the hint says how TRL calls rewards
    assert "the prompt" in message and "the completion" in message


def test_wrong_length_is_an_error_naming_the_function():
    def too_short(prompts, completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match=r"reward 'too_short' returned 1 values for 2 completions"):
        RewardFunction(too_short)(["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match="too_short"):
        score([too_short], [1.0], ["a", "b"], ["x", "y"], {})


def test_non_numbers_are_an_error_naming_the_function():
    def returns_text(prompts, completions, **kwargs):
        return ["1.0" for _ in completions]

    with pytest.raises(ValueError, match=r"reward 'returns_text' returned '1.0' at index 0"):
        RewardFunction(returns_text)(["a"], ["x"])


def test_nan_and_inf_become_none_with_one_warning(caplog):
    def nonfinite(prompts, completions, **kwargs):
        return [math.nan, 1.5, math.inf, -math.inf, None]

    fn = RewardFunction(nonfinite)
    with caplog.at_level(logging.WARNING, logger=GUARD_LOGGER):
        assert fn(["p"] * 5, ["c"] * 5) == [None, 1.5, None, None, None]
    assert fn.num_nonfinite == 3  # the explicit None is an abstention, not a non-finite value
    assert len(caplog.records) == 1 and "nonfinite" in caplog.records[0].getMessage()


def test_score_combines_with_weights_and_nansum():
    def a(prompts, completions, **kwargs):
        return [1.0, None, 2.0]

    def b(prompts, completions, **kwargs):
        return [0.5, None, None]

    result = score([a, b], [2.0, -1.0], ["p"] * 3, ["c"] * 3, {})
    assert isinstance(result, RewardScores)
    assert result.names == ["a", "b"]
    assert result.per_function.dtype == torch.float32 and result.per_function.shape == (3, 2)
    expected = torch.tensor([[1.0, 0.5], [math.nan, math.nan], [2.0, math.nan]])
    torch.testing.assert_close(result.per_function, expected, equal_nan=True, rtol=0, atol=0)
    # row 0: 2*1 - 1*0.5 = 1.5; row 1: everything abstained -> nansum of nothing = 0 (TRL's choice);
    # row 2: 2*2 and b abstains -> 4
    torch.testing.assert_close(result.total, torch.tensor([1.5, 0.0, 4.0]), rtol=0, atol=0)


def test_score_checks_its_inputs():
    def one(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        score([one], [1.0, 2.0], ["p"], ["c"], {})
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 1 completions"):
        score([one], [1.0], ["p"], ["c"], {"answer": ["1", "2"]})
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        score([one], [1.0], ["p", "q"], ["c"], {})


def test_build_and_score_from_specs():
    specs = [
        RewardSpec("answer_correct", weight=1.0),
        RewardSpec("format_think_answer", weight=0.5),
        RewardSpec("strict_format", weight=2.0),
        RewardSpec("strict_format", weight=1.0, params={"tag_style": "reasoning"}),  # per-spec style
    ]
    fns = build_reward_functions(specs, tag_style="think")
    assert [f.name for f in fns] == ["answer_correct", "format_think_answer", "strict_format", "strict_format_2"]
    completions = [
        "<think>\nx\n</think>\n<answer>\n7\n</answer>\n",
        "<reasoning>\nx\n</reasoning>\n<answer>\n7\n</answer>\n",
    ]
    result = score(fns, [s.weight for s in specs], ["q", "q"], completions, {"answer": ["7", "8"]})
    expected = torch.tensor([[1.0, 1.25, 0.5, 0.0], [-1.0, -1.0, 0.0, 0.5]])
    torch.testing.assert_close(result.per_function, expected, rtol=0, atol=0)
    # row 0: 1 + 0.5*1.25 + 2*0.5 + 0 = 2.625; row 1: -1 - 0.5 + 0 + 0.5 = -1.0
    torch.testing.assert_close(result.total, torch.tensor([2.625, -1.0]), rtol=0, atol=0)


def test_build_rejects_bad_specs():
    with pytest.raises(ValueError, match="at least one reward"):
        build_reward_functions([], tag_style="think")
    with pytest.raises(ValueError, match="weight nan"):
        build_reward_functions([RewardSpec("xmlcount", weight=math.nan)], tag_style="think")
    with pytest.raises(ValueError, match=r"unknown reward 'nope'; known: \['answer_correct'"):
        build_reward_functions([RewardSpec("nope")], tag_style="think")
    with pytest.raises(ValueError, match="unknown tag style 'xml'"):
        build_reward_functions([RewardSpec("xmlcount")], tag_style="xml")


def test_scoring_from_a_worker_thread():
    # The trainer may score in a worker thread, where math-verify's signal-based timeout cannot run.
    fns = build_reward_functions([RewardSpec("answer_correct")], tag_style="think")
    completions = ["<think>x</think><answer>\\frac{1}{2}</answer>", "<think>x</think><answer>\\frac{1}{3}</answer>"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        result = pool.submit(score, fns, [1.0], ["q", "q"], completions, {"answer": ["0.5", "0.5"]}).result(timeout=60)
    assert result.per_function[:, 0].tolist() == [1.0, -1.0]
    assert fns[0].num_failures == 0  # correct because it worked, not because errors became None
