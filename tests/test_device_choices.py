"""The per-device-type choices (docs/device-choices.md) as config keys: which SDPA backends the trainer's
passes use (``model.sdpa_backends``), whether the log-prob passes share prompts (``train.shared_prompt_pass``),
how their widths are rounded (``train.column_bucket``), when the fused head takes over
(``train.fused_lm_head``) and whether ``auto`` micro-batches cut by tokens. Here, that each key is checked on
load, reaches every pass that reads it, does what it says (on the CPU), and that the defaults leave the
behaviour alone. The CUDA defaults were decided on an H200 (docs/device-choices.md)."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import grpo.step.logprobs
from grpo.config import ConfigError, load_config
from grpo.models.loading import compute_context, sdpa_backends
from grpo.models.tiny import build_qwen2
from grpo.parallel.learners import UpdateOutcome
from grpo.rollout import SamplingParams
from grpo.step.experience import (
    ExperienceSettings,
    finish_experience,
    generation_logprobs,
)
from grpo.config.device_defaults import PASS_DEFAULTS, PassDefaults
from grpo.step.logprob_pass import LogprobPass, pass_choices
from grpo.step.logprobs import completion_logprobs
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import LossSettings
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch
from grpo.parallel.distributed import DistInfo
from grpo.tasks import run_task
from grpo.training.settings import experience_settings, logprob_pass, loss_settings


def attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_sdpa_backend_names_are_checked():
    assert sdpa_backends(None) is None and sdpa_backends("auto") is None  # "auto": the benchmarks' flag value
    assert sdpa_backends("efficient, math") == ("EFFICIENT_ATTENTION", "MATH")
    assert sdpa_backends("cudnn,FLASH_ATTENTION") == ("CUDNN_ATTENTION", "FLASH_ATTENTION")
    with pytest.raises(ValueError, match="unknown.*'FAST'"):
        sdpa_backends("fast")
    with pytest.raises(ValueError, match="none given"):
        sdpa_backends(",")


def test_sdpa_backends_key_is_checked_on_load():
    assert load_config(None, []).model.sdpa_backends is None  # torch's choice
    assert load_config(None, ["model.sdpa_backends=efficient,math"]).model.sdpa_backends == "efficient,math"
    with pytest.raises(ConfigError, match=r"model\.sdpa_backends is 'fast': unknown \['FAST'\]; "
                                          r"known: flash, efficient, cudnn, math \(or null"):
        load_config(None, ["model.sdpa_backends=fast"])
    with pytest.raises(ConfigError, match="model.sdpa_backends is set but model.attn_implementation is 'eager'"):
        load_config(None, ["model.sdpa_backends=math", "model.attn_implementation=eager"])
    load_config(None, ["model.sdpa_backends=math", "model.attn_implementation=sdpa"])


def test_compute_context_applies_the_configured_backends():
    q = torch.randn(1, 2, 5, 8)
    expected = attention(q)
    default = load_config(None, []).model
    assert isinstance(compute_context(default, torch.device("cpu"), False), nullcontext)  # nothing set: as before
    only_efficient = compute_context(load_config(None, ["model.sdpa_backends=efficient"]).model,
                                     torch.device("cpu"), False)  # no CPU kernel of its own
    with only_efficient, pytest.raises(RuntimeError, match="[Nn]o (available kernel|viable backend)"):
        attention(q)
    assert torch.equal(attention(q), expected)  # left: torch's choice again
    math_only = compute_context(load_config(None, ["model.sdpa_backends=math"]).model, torch.device("cpu"), False)
    with math_only:  # re-enterable and nestable, as the trainer enters its context more than once
        with math_only:
            torch.testing.assert_close(attention(q), expected)
        torch.testing.assert_close(attention(q), expected)
    with math_only:
        torch.testing.assert_close(attention(q), expected)


def test_backends_and_autocast_together():
    a = torch.randn(4, 4)
    bf16 = load_config(None, ["model.bf16=true"]).model  # full fine-tuning in bf16: autocast over fp32 weights
    with compute_context(bf16, torch.device("cpu"), False):
        assert (a @ a).dtype == torch.bfloat16
    with compute_context(dataclasses.replace(bf16, sdpa_backends="math"), torch.device("cpu"), False):
        assert (a @ a).dtype == torch.bfloat16
        attention(torch.randn(1, 2, 5, 8))
    assert (a @ a).dtype == torch.float32


def test_pass_choices_fill_in_the_device_types_defaults():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pass_choices(cpu, None, None) == (True, 1)  # no extra columns: padding is only compute on a CPU
    assert pass_choices(cuda, None, None) == (False, 64)  # the plain pass, shapes that repeat on a GPU
    assert pass_choices(torch.device("meta"), None, None) == (True, 1)  # other device types: the CPU's
    assert pass_choices(cuda, False, 8) == (False, 8)  # a value given wins
    with pytest.raises(TypeError):
        PASS_DEFAULTS["cuda"] = PASS_DEFAULTS["cpu"]  # nothing assigns into the defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        PASS_DEFAULTS["cuda"].share_prompts = True  # type: ignore[misc]
    assert isinstance(PASS_DEFAULTS["cpu"], PassDefaults)


def test_pass_keys_are_checked_and_reach_the_settings():
    cfg = load_config(None, [])
    assert (cfg.train.shared_prompt_pass, cfg.train.column_bucket) == (None, None)  # the device's defaults
    assert logprob_pass(cfg) == LogprobPass()
    cfg = load_config(None, ["train.shared_prompt_pass=off", "train.column_bucket=8"])  # YAML: off is false
    chosen = LogprobPass(share_prompts=False, column_bucket=8)
    assert logprob_pass(cfg) == chosen
    assert loss_settings(cfg, None, "cpu").logprob_pass == chosen
    assert experience_settings(cfg, None, task=run_task(cfg), decoupled_sampler=False,
                               engine_holds_weights=False).logprob_pass == chosen
    assert logprob_pass(load_config(None, ["train.shared_prompt_pass=on"])).share_prompts is True
    with pytest.raises(ConfigError, match="train.column_bucket: 0 is out of range: must be >= 1"):
        load_config(None, ["train.column_bucket=0"])
    with pytest.raises(ConfigError, match="train.shared_prompt_pass: expected bool or null"):
        load_config(None, ["train.shared_prompt_pass=sometimes"])


def grouped(vocab: int, groups: int = 2, G: int = 2, Lp: int = 6, Lc: int = 5) -> Generation:
    """``groups`` prompts, each repeated for its ``G`` completions (so a shared pass has prompts to share)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, vocab, (groups, Lp), generator=g).repeat_interleave(G, 0)  # [N, Lp]
    completion = torch.randint(5, vocab, (groups * G, Lc), generator=g)  # [N, Lc]
    return Generation(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                      completion_mask=torch.ones_like(completion), truncated=torch.zeros(groups * G, dtype=torch.bool),
                      completions=[""] * groups * G)


@pytest.fixture
def shared_calls(monkeypatch) -> list[int]:
    """One entry per shared prompt pass run."""
    calls = []
    shared = grpo.step.logprobs._shared_prompt_logits
    monkeypatch.setattr(grpo.step.logprobs, "_shared_prompt_logits", lambda *a: calls.append(1) or shared(*a))
    return calls


def test_completion_logprobs_follow_the_device_types_choice(tiny_tokenizer, shared_calls):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).eval()
    gen = grouped(len(tiny_tokenizer))
    args = (model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, 1.0)
    with torch.no_grad():
        on = completion_logprobs(*args)
        assert len(shared_calls) == 1  # the CPU's default: shared
        off = completion_logprobs(*args, share_prompts=False)
        assert len(shared_calls) == 1  # the plain pass
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)


def test_old_logprobs_and_the_update_follow_their_settings(tiny_tokenizer, shared_calls):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).train()
    gen = grouped(len(tiny_tokenizer), Lc=8)
    gen.completion_mask[:, 2:] = 0  # 2 real completion columns of 8
    widths = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    plain = LogprobPass(share_prompts=False, column_bucket=4)
    generation_logprobs(model, gen, 1.0, 4, logprob_pass=plain)
    assert shared_calls == [] and widths == [6 + 4]  # one plain pass, 2 completion columns rounded up to 4
    generation_logprobs(model, gen, 1.0, 4, logprob_pass=LogprobPass(share_prompts=False))
    assert widths[-1] == 6 + 2  # the CPU's default bucket: 1
    N = gen.prompt_ids.shape[0]
    batch = RolloutBatch(generation=gen, rewards=torch.randn(N), reward_parts=torch.zeros(N, 1), reward_names=["r"],
                         advantages=torch.zeros(N), old_logprobs=None, ref_logprobs=None, prompts=["a", "b"])
    settings = ExperienceSettings(sampling=SamplingParams(n=2), system_prompt=None, max_prompt_length=64, advantage_estimator="grpo", scale_rewards=None,
                                  advantage_eps=1e-4, need_old_logprobs=True, logprob_batch_size=4)
    with_old = finish_experience(batch, model, None, dataclasses.replace(settings, logprob_pass=plain))
    assert shared_calls == [] and with_old.old_logprobs is not None  # the old log-probs' pass follows the settings
    finish_experience(batch, model, None, settings)
    assert len(shared_calls) == 1  # the CPU's default: shared

    class Learner:  # the update's forward and backward only
        module = model
        lr = 0.0

        def accumulating(self, last):
            return nullcontext()

        def backward(self, loss):
            loss.backward()

        def finish_update(self):
            model.zero_grad(set_to_none=True)
            return UpdateOutcome(0.0)

    batch = dataclasses.replace(batch, advantages=torch.randn(N))
    base = {"epsilon": 0.2, "epsilon_high": None, "beta": 0.0, "loss_type": "grpo", "max_completion_length": 8,
            "temperature": 1.0, "num_iterations": 1, "micro_batch_size": N, "max_grad_norm": None}
    calls = len(shared_calls)
    train_on_batch(Learner(), batch, LossSettings(**base, logprob_pass=plain), DistInfo()).totals
    assert len(shared_calls) == calls  # train.shared_prompt_pass: false reaches the update
    train_on_batch(Learner(), batch, LossSettings(**base), DistInfo()).totals
    assert len(shared_calls) == calls + 1  # the CPU's default: shared
