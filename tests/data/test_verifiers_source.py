"""verifiers environments as a data source (grpo.data.verifiers_env) and their episodes as rows
(grpo.multiturn.verifiers_rollout.merge_turns): the spec grammar and its errors, the missing package naming the
extra, an unknown taskset listing the known ones, and the recorded turns joined into one sequence."""

from __future__ import annotations

import sys

import pytest

from grpo.data import DataError, load_dataset_source
from grpo.data.verifiers_env import VfSpec, parse_spec
from grpo.multiturn.verifiers_rollout import merge_turns
from grpo.rollout.generate_endpoint import Turn


def test_spec_taskset_options_and_renderer_fields():
    assert parse_spec("s", "my-tasks") == VfSpec("my-tasks")
    spec = parse_spec("s", "my_tasks, env=best-of-n ,harness=bash,limit=7,max_tokens=9,concurrency=3,timeout_s=2.5,"
                           "renderer=qwen3,renderer.thinking_retention=all")
    assert spec == VfSpec("my_tasks", "best-of-n", "bash", 7, 9, 3, 2.5,
                          (("name", "qwen3"), ("thinking_retention", "all")))


@pytest.mark.parametrize("text, says", [
    ("", "starts with a verifiers taskset id"),
    ("limit=3", "starts with a verifiers taskset id"),
    ("t,limit=x", "limit must be an integer"),
    ("t,limit=0", "at least 1"),
    ("t,max_tokens=0", "at least 1"),
    ("t,concurrency=0", "at least 1"),
    ("t,timeout_s=-1", "positive"),
    ("t,timeout_s=soon", "must be a number"),
    ("t,color=red", "expected one of ['env', 'harness', 'limit', 'max_tokens', 'concurrency', 'timeout_s', "
                    "'renderer'] or renderer.KEY"),
    ("t,env", "expected one of"),
    ("t,env=a,env=b", "given twice"),
    ("t,renderer.thinking_retention=all", "need renderer=NAME"),
])
def test_a_malformed_spec_says_what_is_wrong(text, says):
    with pytest.raises(DataError, match="data source 'verifiers:"):
        try:
            parse_spec(f"verifiers:{text}", text)
        except DataError as error:
            assert says in str(error)
            raise


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers now fails
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(DataError, match=r"pip install 'grpo\[envs\]'"):
        load_dataset_source("verifiers:no_such_taskset_for_grpo_tests")


@pytest.mark.slow  # imports verifiers (seconds)
def test_an_unknown_taskset_lists_the_known_ones():
    pytest.importorskip("verifiers.v1")
    with pytest.raises(DataError, match=r"no_such_taskset_for_grpo_tests.*verifiers' own tasksets: \[.*openenv"):
        load_dataset_source("verifiers:no_such_taskset_for_grpo_tests")
    with pytest.raises(DataError, match=r"environment 'no_such_env'.*environments: \[.*'single_agent'"):
        load_dataset_source("verifiers:openenv,env=no_such_env")


def turn(prompt, completion, logprob=-1.0):
    return Turn(prompt, completion, [logprob] * len(completion), True)


def test_turns_join_into_one_row_replies_trained_the_rest_context():
    # turn 1's prompt is turn 0's prompt and reply, then a tool result [7, 8]
    prompt, ids, loss, logprobs = merge_turns([turn([1, 2], [3, 4], -0.5), turn([1, 2, 3, 4, 7, 8], [9], -0.25)])
    assert prompt == [1, 2]
    assert ids == [3, 4, 7, 8, 9]
    assert loss == [1, 1, 0, 0, 1]
    assert logprobs == [-0.5, -0.5, 0.0, 0.0, -0.25]


def test_a_turn_that_does_not_extend_the_last_is_refused():
    with pytest.raises(ValueError, match="turn 1's prompt does not extend turn 0's"):
        merge_turns([turn([1, 2], [3, 4]), turn([1, 2, 3, 5], [9])])  # the reply was re-rendered
    with pytest.raises(ValueError, match="no model call"):
        merge_turns([])


def test_a_verifiers_rollout_refuses_an_example_of_another_source():
    from grpo.data import Example
    from grpo.multiturn.verifiers_rollout import VerifiersRollout

    rollout = VerifiersRollout.__new__(VerifiersRollout)  # only the spec is read
    rollout.spec, rollout.tasks = "verifiers:mine", ["task 0"]
    mine = Example([{"role": "user", "content": "q"}], None, None, "verifiers:mine#0", row={"verifiers_task": 0})
    assert rollout._task(mine) == "task 0"
    other = Example([{"role": "user", "content": "q"}], "4", "4", "data/test.jsonl:3")
    with pytest.raises(DataError, match="data/test.jsonl:3: not a task of 'verifiers:mine'"):
        rollout._task(other)
