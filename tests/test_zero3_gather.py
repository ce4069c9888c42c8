"""The ZeRO-3 gather of full weights for publishing and saving: in buckets, a CPU copy on rank 0 only."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from grpo.parallel.learners import _buckets, zero3_full_state_dict

deepspeed = pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")


class TiedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as in Qwen2.5-0.5B
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


class FakeEngine:
    def __init__(self, module):
        self.module = module

    def zero_optimization_stage(self) -> int:
        return 3


class FakeLearner:
    def __init__(self, module):
        self.engine = FakeEngine(module)


def test_buckets_keep_order_and_bound_their_size():
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([3, 3, 5, 1, 9])]
    buckets = _buckets(params, numel=6)
    assert [[n for n, _ in b] for b in buckets] == [["p0", "p1"], ["p2", "p3"], ["p4"]]


def test_gathered_in_buckets_equal_the_state_dict_with_a_tied_weight_once(monkeypatch):
    model = TiedModel()
    gathers = []

    @contextmanager
    def recording(params, modifier_rank=None):
        gathers.append(len(params))
        yield

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", recording)
    gathered = zero3_full_state_dict(FakeLearner(model), bucket_numel=20)
    expected = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # the tie, written once
    assert list(gathered) != [] and set(gathered) == set(expected)
    assert all(torch.equal(gathered[k], expected[k]) and gathered[k].device.type == "cpu" for k in expected)
    assert gathers == [1, 2], "embed (40) alone, then body weight + bias (20)"


def test_other_ranks_gather_but_keep_no_copy(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", contextmanager(lambda params, modifier_rank=None: (
        yield)))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert zero3_full_state_dict(FakeLearner(TiedModel())) == {}


@pytest.mark.parametrize("version, ok", [("0.19.8", True), ("0.20.0+cu130", True), ("1.0.0", True),
                                         ("0.18.0", False), ("0.19.7", False), ("0.19.8rc1", True)])
def test_a_deepspeed_older_than_the_floor_is_refused_by_name(version, ok):
    from grpo.config import ConfigError
    from grpo.parallel.learners import check_deepspeed_version

    if ok:
        check_deepspeed_version(version)
    else:
        with pytest.raises(ConfigError, match=f"deepspeed {version} is installed; grpo needs >= 0.19.8"):
            check_deepspeed_version(version)
