"""Rewards are called exactly as TRL 1.16's GRPOTrainer calls them: by keyword, with completion_ids, the
dataset columns, trainer_state, log_extra and log_metric; async functions awaited together; factories
built from config; columns read under another name. TRL's own rewards run unchanged."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from grpo.config import RewardConfig

from grpo.config import ConfigError, load_config
from grpo.rewards import RewardError, RewardFunction, build_reward_functions, score
from grpo.rewards.context import RewardContext, make_trainer_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import unsloth_rewards  # noqa: E402  (the five as users write them)

PROMPTS = [[{"role": "user", "content": "What is 2+2?"}]] * 3
GOOD = "<reasoning>\n2+2\n</reasoning>\n<answer>\n4\n</answer>\n"
TEXTS = [GOOD, "<reasoning>x</reasoning><answer>5</answer>", "no tags at all"]
COMPLETIONS = [[{"role": "assistant", "content": t}] for t in TEXTS]
IDS = [[1, 2, 3], [4] * 9, [5] * 12]
COLUMNS = {"answer": ["4", "4", "4"], "question": ["What is 2+2?"] * 3}


def run(specs, context=None, columns=COLUMNS, tag_style="reasoning"):
    fns = build_reward_functions(specs, tag_style, column_names=list(columns))
    return score(fns, [1.0] * len(fns), PROMPTS, COMPLETIONS, columns, IDS, context)


def test_every_argument_arrives_by_keyword_as_trl_passes_it():
    received = {}

    def keyword_only(*, prompts, completions, completion_ids, answer, question, trainer_state, log_extra,
                     log_metric, **kwargs):  # keyword-only: a positional call would raise
        received.update(prompts=prompts, completion_ids=completion_ids, answer=answer, state=trainer_state,
                        extra=kwargs)
        return [1.0] * len(completions)

    context = RewardContext(make_trainer_state(global_step=7, max_steps=20))
    scores = score([keyword_only], [1.0], PROMPTS, COMPLETIONS, COLUMNS, IDS, context)
    assert scores.total.tolist() == [1.0, 1.0, 1.0]
    assert received["prompts"] == PROMPTS and received["completion_ids"] == IDS and received["answer"] == ["4"] * 3
    assert (received["state"].global_step, received["state"].max_steps) == (7, 20)
    assert received["extra"] == {}  # nothing beyond TRL's set


def test_the_unsloth_five_as_users_write_them_match_the_builtins():
    names = {"correctness_reward_func": "correctness", "int_reward_func": "int_answer",
             "strict_format_reward_func": "strict_format", "soft_format_reward_func": "soft_format",
             "xmlcount_reward_func": "xmlcount"}
    user = run([RewardConfig(f"unsloth_rewards:{fn}") for fn in names])
    builtin = run([RewardConfig(name) for name in names.values()])
    assert user.per_function.tolist() == builtin.per_function.tolist()
    # hand-computed for GOOD: correctness 2.0, int 0.5, strict 0.5, soft 0.0 (no DOTALL: the seed's
    # regex cannot cross the newlines), xmlcount 4 x 0.125 minus 0.001 x (len("\n") - 1) = 0.5
    assert user.per_function[0].tolist() == [2.0, 0.5, 0.5, 0.0, 0.5]


def test_log_metric_and_log_extra_collect_in_the_context():
    context = RewardContext(make_trainer_state(global_step=5, max_steps=10))
    scores = run([RewardConfig("unsloth_rewards:length_curriculum")], context)
    assert scores.per_function[:, 0].tolist() == pytest.approx([-0.5 * 3 / 100, -0.5 * 9 / 100, -0.5 * 12 / 100])
    assert context.metric_means() == {"curriculum/progress": 0.5}
    assert context.extra_columns(3) == {"num_tokens": [3, 9, 12]}


def test_async_rewards_are_awaited_together():
    # Each waits for the other to have started: only a concurrent gather finishes (a sequential run
    # would time out, every sample would fail, and score would raise RewardError).
    started = {"a": None, "b": None}

    def make(me: str, other: str):
        async def reward(completions, **kwargs):
            started[me] = started[me] or asyncio.Event()
            started[me].set()
            while started[other] is None:
                await asyncio.sleep(0.001)
            await asyncio.wait_for(started[other].wait(), timeout=5)
            return [1.0] * len(completions)

        reward.__name__ = f"async_{me}"
        reward.per_sample_fallback = False
        return reward

    scores = score([make("a", "b"), make("b", "a"), unsloth_rewards.int_reward_func], [1.0, 2.0, 1.0],
                   PROMPTS, COMPLETIONS, COLUMNS, IDS)
    assert scores.names == ["async_a", "async_b", "int_reward_func"]
    # 1 x 1 + 2 x 1 + int_reward: 0.5 where the extracted answer is digits ("4", "5"), 0 for "no tags at all"
    assert scores.total.tolist() == [3.5, 3.5, 3.0]


def test_an_async_reward_that_fails_on_every_sample_is_an_error():
    async def broken(completions, **kwargs):
        raise KeyError("judge")

    with pytest.raises(RewardError, match=r"'broken' failed on every one of the 3 samples.*KeyError"):
        score([broken], [1.0], PROMPTS, COMPLETIONS, COLUMNS, IDS)


def test_a_user_factory_is_built_once_with_its_arguments():
    spec = RewardConfig("unsloth_rewards:make_keyword_bonus", factory_args={"keyword": "2+2", "bonus": 0.25})
    scores = run([spec])
    assert scores.names == ["keyword_bonus"] and scores.total.tolist() == [0.25, 0.0, 0.0]


def test_factory_errors_name_the_factory():
    with pytest.raises(ValueError, match=r"make_keyword_bonus.*bad factory_args \['bonus', 'typo'\].*accepted"):
        run([RewardConfig("unsloth_rewards:make_keyword_bonus", factory_args={"typo": 1, "bonus": 1.0})])
    with pytest.raises(ValueError, match="a built-in reward takes its settings in params"):
        run([RewardConfig("xmlcount", factory_args={})])


def test_a_signature_that_cannot_take_the_keyword_call_is_refused_before_the_run(monkeypatch):
    def reads_a_missing_column(completions, answers, **kwargs):  # "answers": the data has "answer"
        return [0.0] * len(completions)

    def no_kwargs(prompts, completions):
        return [0.0] * len(completions)

    monkeypatch.setattr(unsloth_rewards, "reads_a_missing_column", reads_a_missing_column, raising=False)
    monkeypatch.setattr(unsloth_rewards, "no_kwargs", no_kwargs, raising=False)
    for name in ("reads_a_missing_column", "no_kwargs"):
        with pytest.raises(ValueError, match=rf"reward 'unsloth_rewards:{name}' cannot be called with the "
                                             r"keywords.*\*\*kwargs"):
            build_reward_functions([RewardConfig(f"unsloth_rewards:{name}")], "think", column_names=list(COLUMNS))


def test_column_mapping_reads_a_column_under_another_name():
    def reads_solution(completions, solution, **kwargs):
        return [float(s) for s in solution]

    fn = RewardFunction(reads_solution, column_map={"solution": "answer"})
    assert fn(PROMPTS, COMPLETIONS, IDS, None, **COLUMNS) == [4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match=r"columns reads the dataset columns \['gold'\].*its columns"):
        run([RewardConfig("unsloth_rewards:int_reward_func", columns={"x": "gold"})])


def test_config_checks_factory_args_and_columns(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rewards:\n  - {name: xmlcount, factory_args: {a: 1}}\n  - {name: 'm:f', columns: {1: answer}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(recipe)
    assert "rewards[0].factory_args" in str(caught.value) and "rewards[1].columns" in str(caught.value)


trl_rewards = pytest.importorskip("trl.rewards")  # the test extra installs trl; skip only where it is absent


def test_trls_own_rewards_run_unchanged():
    specs = [RewardConfig("trl.rewards:think_format_reward"),
             RewardConfig("trl.rewards:accuracy_reward", columns={"solution": "answer"}),
             RewardConfig("trl.rewards:get_soft_overlong_punishment",
                        factory_args={"max_completion_len": 10, "soft_punish_cache": 4})]
    context = RewardContext()
    scores = run(specs, context)
    assert scores.names == ["think_format_reward", "accuracy_reward", "soft_overlong_punishment_reward"]
    assert not scores.per_function.isnan().any()  # every sample scored by every function
    # think_format: no <think> block anywhere -> 0. accuracy: math-verify reads "4" from the answer block of
    # the first, "5" of the second, nothing of the third. Overlong (L_max 10, cache 4): 3 tokens <= 6 -> 0;
    # 9 tokens -> (6 - 9) / 4 = -0.75; 12 > 10 -> -1.
    assert scores.per_function[:, 0].tolist() == [0.0, 0.0, 0.0]
    assert scores.per_function[:, 2].tolist() == [0.0, -0.75, -1.0]
    assert set(context.extra_columns(3)) == {"solution", "gold_parsed", "answer_parsed"}  # accuracy's log_extra
    # accuracy_reward wants a LaTeX answer (\boxed first); none of these has one, so 0 for all three; with
    # the gold read from "answer" through the column mapping, a boxed 4 scores 1 and a boxed 5 scores 0.
    assert scores.per_function[:, 1].tolist() == [0.0, 0.0, 0.0]
    boxed = [[{"role": "assistant", "content": f"so the answer is $\\boxed{{{v}}}$"}] for v in (4, 5, 4)]
    fns = build_reward_functions(specs[1:2], "think", column_names=list(COLUMNS))
    assert score(fns, [1.0], PROMPTS, boxed, COLUMNS, IDS).total.tolist() == [1.0, 0.0, 1.0]


def test_a_logged_metric_that_would_overwrite_one_of_grpos_is_an_error():
    from grpo.step.metrics import reward_logged_metrics
    from grpo.parallel.distributed import DistInfo

    with pytest.raises(RewardError, match=r"log_metric used the names \['loss'\], which grpo logs itself"):
        reward_logged_metrics({"loss": 1.0, "judge/s": 2.0}, {"loss", "kl"}, DistInfo())
    assert reward_logged_metrics({"judge/s": 2.0}, {"loss", "kl"}, DistInfo()) == {"judge/s": 2.0}
