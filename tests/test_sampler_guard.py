"""The off-policy guard (grpo.rollout.offpolicy_guard): its math, its schedule, its error, and a real `grpo train` run
driven by a stand-in engine that holds "its own weights" (as vLLM does) and whose log-probs can be made
to drift from the policy's at a chosen step."""

from __future__ import annotations

import math

import pytest
from step_helpers import logged, run_train
import torch

from grpo.algorithm import logprob_mismatch
from grpo.errors import OffPolicySampling
from grpo.rollout.offpolicy_guard import check_sampler_logprobs, is_check_step
from grpo.parallel.distributed import DistInfo


def test_logprob_mismatch_is_the_masked_sum_and_count():
    sampler = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -9.0], [-0.25, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    total, count = logprob_mismatch(sampler, trainer, mask)
    # masked tokens: |-1 + 1.5| = 0.5, |-2 + 2| = 0, |-0.5 + 0.25| = 0.25; the -9s are padding and ignored
    assert total.item() == pytest.approx(0.75, abs=1e-12) and count.item() == 3


def test_logprob_mismatch_matches_a_loop_reference():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).long()
    expected = sum(abs(a[i, j].item() - b[i, j].item()) for i in range(5) for j in range(7) if mask[i, j])
    total, count = logprob_mismatch(a, b, mask)
    assert total.item() == pytest.approx(expected, rel=1e-12) and count.item() == int(mask.sum())


def test_check_steps_are_the_first_two_then_every_nth():
    assert [s for s in range(1, 31) if is_check_step(s, 10)] == [1, 2, 10, 20, 30]
    assert [s for s in range(1, 6) if is_check_step(s, 1)] == [1, 2, 3, 4, 5]
    assert not any(is_check_step(s, 0) for s in range(1, 31))
    # a run resumed after step 13: its first two steps (a freshly built engine), then the schedule
    assert [s for s in range(14, 31) if is_check_step(s, 10, first_step=14)] == [14, 15, 20, 30]


def test_the_check_passes_below_the_threshold_and_names_step_and_gap_above_it():
    trainer = torch.full((2, 3), -1.0)
    mask = torch.ones(2, 3)
    assert check_sampler_logprobs(5, trainer + 0.01, trainer, mask, 0.1, DistInfo()) == {
        "rollout/logprob_diff": pytest.approx(0.01)}
    with pytest.raises(OffPolicySampling, match=r"step 7: .* by 0\.25 on average over 6 tokens "
                                                r"\(rollout.vllm_max_logprob_diff 0\.1\)"):
        check_sampler_logprobs(7, trainer - 0.25, trainer, mask, 0.1, DistInfo())
    with pytest.raises(OffPolicySampling, match="by nan"):  # NaN compares False with any threshold
        check_sampler_logprobs(8, trainer * math.nan, trainer, mask, 0.1, DistInfo())


def test_top_p_with_the_check_on_is_a_config_error_naming_the_key():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout.vllm_check_steps .*renormalised over the kept tokens"):
        load_config(None, ["rollout.engine=vllm", "rollout.top_p=0.9"])
    load_config(None, ["rollout.engine=vllm", "rollout.top_p=0.9", "rollout.vllm_check_steps=0"])


@pytest.mark.slow
def test_an_engine_on_the_policy_is_checked_on_schedule_with_one_iteration(monkeypatch, tiny_model_dir, tmp_path):
    box: dict = {}
    out = tmp_path / "run"
    assert run_train(monkeypatch, tiny_model_dir, out, box, "train.max_steps=5", "loss.num_iterations=1",
                     "rollout.vllm_check_steps=4") == 0
    rows = [r for r in logged(out) if "loss" in r]
    checked = {r["step"]: r["rollout/logprob_diff"] for r in rows if "rollout/logprob_diff" in r}
    assert sorted(checked) == [1, 2, 4]  # steps 1, 2, then every 4th; nothing on 3 and 5
    assert max(checked.values()) < 1e-5  # the same weights on both sides
    assert box["engine"].pushed == [1, 2, 3, 4, 5]  # pushed after every update


@pytest.mark.slow
def test_a_drifting_engine_stops_the_run_naming_the_step_and_the_gap(monkeypatch, tiny_model_dir, tmp_path,
                                                                      capsys):
    box = {"kwargs": {"drift": 0.5, "drift_from_call": 3}}
    out = tmp_path / "run"
    # data.eval null: evaluation samples through the run's engine too, and the drift counts engine calls
    status = run_train(monkeypatch, tiny_model_dir, out, box, "train.max_steps=6", "loss.num_iterations=1",
                       "rollout.vllm_check_steps=3", "data.eval=null")
    assert status == 1
    err = capsys.readouterr().err
    assert "grpo: training aborted: step 3: the rollout engine's log-probs" in err
    assert "by 0.5 on average" in err and "rollout.vllm_max_logprob_diff 0.1" in err
    # steps 1 and 2 were checked and trained; step 3's batch was refused before its update
    rows = [r for r in logged(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_diff"] < 1e-5 for r in rows)


@pytest.mark.slow
def test_with_two_iterations_every_step_is_checked_from_the_old_logprobs(monkeypatch, tiny_model_dir, tmp_path):
    box = {"kwargs": {"drift": 0.05}}  # below the threshold: logged every step, never stops
    out = tmp_path / "run"
    assert run_train(monkeypatch, tiny_model_dir, out, box, "train.max_steps=3", "loss.num_iterations=2",
                     "rollout.vllm_check_steps=10") == 0
    rows = [r for r in logged(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/logprob_diff"] == pytest.approx(0.05, abs=1e-5) for r in rows)
