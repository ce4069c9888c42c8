"""The reward registry and user rewards by dotted path."""

from __future__ import annotations

import textwrap

import pytest

from grpo.config import RewardConfig
from grpo.rewards import (
    REWARD_REGISTRY,
    build_reward_functions,
    get_reward_function,
    list_rewards,
    register_reward,
    score,
)

BUILTINS = [
    "answer_correct",
    "correctness",
    "format_think_answer",
    "int_answer",
    "kk_logic",
    "model",
    "reasoning_gym",
    "remote",
    "soft_format",
    "strict_format",
    "xmlcount",
]


def test_list_rewards():
    assert list_rewards() == BUILTINS


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as error:
        get_reward_function("answer_corect")
    message = str(error.value)
    assert "unknown reward 'answer_corect'" in message
    assert all(name in message for name in BUILTINS)
    assert "package.module:function" in message


def test_bad_parameters_name_the_accepted_ones():
    with pytest.raises(ValueError, match=r"reward 'remote': bad parameters \['uri'\].*accepted: \['url'"):
        get_reward_function("remote", uri="http://x")
    with pytest.raises(ValueError, match=r"reward 'xmlcount': bad parameters \['scale'\]"):
        get_reward_function("xmlcount", scale=2)


def test_register_reward():
    def make_length(tag_style=None, scale: float = 1.0):
        def length(prompts, completions, **kwargs):
            return [scale * len(c) for c in completions]

        return length

    register_reward("_probe", make_length)
    try:
        assert get_reward_function("_probe", tag_style="think", scale=0.5)(["p"], ["abcd"]) == [2.0]
        with pytest.raises(ValueError, match="already registered"):
            register_reward("_probe", make_length)
        with pytest.raises(ValueError, match="must not contain ':'"):
            register_reward("a:b", make_length)
    finally:
        del REWARD_REGISTRY["_probe"]  # leave the registry as other tests expect it


def write_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_dotted_path_loads_a_trl_reward_unchanged(tmp_path, monkeypatch):
    write_module(
        tmp_path,
        monkeypatch,
        "my_rewards_probe",
        """
        def brevity(prompts, completions, **kwargs):
            return [1.0 / len(c) for c in completions]

        def scaled(prompts, completions, scale, **kwargs):
            return [scale * len(c) for c in completions]

        class Holder:
            @staticmethod
            def one(prompts, completions, **kwargs):
                return [1.0] * len(completions)

        NOT_A_FUNCTION = 3
        """,
    )
    import my_rewards_probe

    fn = get_reward_function("my_rewards_probe:brevity", tag_style="think")
    assert fn is my_rewards_probe.brevity  # the user's function itself, as TRL would call it
    assert fn(["p", "p"], ["ab", "abcd"]) == [0.5, 0.25]
    # params become extra keyword arguments on every call; the name stays the function's
    scaled = get_reward_function("my_rewards_probe:scaled", scale=3.0)
    assert scaled.__name__ == "scaled" and scaled(prompts=["p"], completions=["ab"]) == [6.0]
    assert get_reward_function("my_rewards_probe:Holder.one")(["p"], ["x"]) == [1.0]

    fns = build_reward_functions(
        [RewardConfig("my_rewards_probe:brevity", weight=2.0), RewardConfig("xmlcount", weight=0.0)], tag_style="think"
    )
    assert [f.name for f in fns] == ["brevity", "xmlcount"]
    assert score(fns, [2.0, 0.0], ["p"], ["abcd"], {}).total.tolist() == [0.5]  # 2 * 1/4


def test_dotted_path_errors_name_the_path(tmp_path, monkeypatch):
    write_module(
        tmp_path,
        monkeypatch,
        "my_rewards_errors_probe",
        """
        NOT_A_FUNCTION = 3
        """,
    )
    write_module(tmp_path, monkeypatch, "my_rewards_broken_probe", "import missing_dependency_probe\n")
    with pytest.raises(ValueError, match=r"reward 'no_such_module_probe:f': no module named 'no_such_module_probe'"):
        get_reward_function("no_such_module_probe:f")
    with pytest.raises(
        ValueError, match=r"reward 'my_rewards_errors_probe:missing': module 'my_rewards_errors_probe' has no attribute 'missing'"
    ):
        get_reward_function("my_rewards_errors_probe:missing")
    with pytest.raises(ValueError, match=r"'NOT_A_FUNCTION' is a int, not a function"):
        get_reward_function("my_rewards_errors_probe:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match=r"must look like 'package.module:function'"):
        get_reward_function("my_rewards_errors_probe:")
    # A module that exists but fails to import is reported as such, not as "no module named".
    with pytest.raises(ImportError, match=r"importing 'my_rewards_broken_probe' failed.*missing_dependency_probe"):
        get_reward_function("my_rewards_broken_probe:f")
