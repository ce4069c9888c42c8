"""train.torch_compile: the policy's decoder compiled (dynamic shapes) inside the update's micro-batches gives the
eager update's log-probs, losses and gradients (float re-association only) on every pass the update runs (plain,
shared prompt, fused head, packed), with LoRA and gradient checkpointing, and a run trains with it.

Most tests compile with ``aot_eager``: dynamo's tracing and AOT autograd's forward and backward graphs, which are
what could change the values, without inductor's C++ build (1-2 minutes a graph on the 2-core CPU); one test runs
inductor itself (the default backend) over two shapes."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from step_helpers import RecordingLearner, random_batch, settings_with
from torch._dynamo.utils import counters

from grpo.config import ConfigError, load_config
from grpo.models.compiled import CompiledDecoder, CompileSettings, check_compile
from grpo.models.tiny import build_qwen2
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import TorchLearner, UpdateOutcome
from grpo.run.tracking import read_metrics
from grpo.step.logprob_pass import LogprobPass
from grpo.step.policy_update import train_on_batch
from grpo.training.colocated import train

AOT = CompileSettings(backend="aot_eager")


class CompiledRecording(TorchLearner):
    """The torch learner's micro-batch context (the compiled decoder swapped in) recording each update's gradient
    instead of stepping, as ``RecordingLearner`` does for the eager side."""

    def __init__(self, module, compiled: CompiledDecoder):
        super().__init__(module, None, None, None, compiled=compiled)
        self.grads = []

    def finish_update(self) -> UpdateOutcome:
        self.grads.append({n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None})
        self.module.zero_grad(set_to_none=True)
        return UpdateOutcome(0.0)

    lr = 0.0


def model_with(tokenizer, lora: bool = False, checkpointing: bool = False):
    model = build_qwen2(tokenizer, hidden_size=32, num_layers=2, seed=0)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def grouped(batch):
    """``batch`` with each pair of rows sharing its first row's prompt (its groups of G = 2, as sampled)."""
    g = batch.generation
    g.prompt_ids, g.prompt_mask = g.prompt_ids[::2].repeat_interleave(2, 0), g.prompt_mask[::2].repeat_interleave(2, 0)
    return batch


def assert_compiled_update_is_the_eager_one(model, tokenizer, passes: dict[str, LogprobPass], settings=AOT):
    compiled = CompiledDecoder(model, settings)
    for name, logprob_pass in passes.items():
        for seed, (N, Lc) in enumerate([(6, 7), (8, 11)]):  # two shapes: the second reuses the dynamic graph
            batch = grouped(random_batch(len(tokenizer), N=N, Lc=Lc, seed=seed))
            s = settings_with(beta=0.04, max_completion_length=Lc, logprob_pass=logprob_pass, num_iterations=2)
            graphs = counters["stats"]["unique_graphs"]
            ours = CompiledRecording(model, compiled)
            got = train_on_batch(ours, batch, s, DistInfo()).totals
            assert seed or counters["stats"]["unique_graphs"] > graphs, f"{name}: nothing was compiled"
            assert "forward" not in vars(compiled.module)  # the eager forward is back after the update
            eager = RecordingLearner(model)
            want = train_on_batch(eager, batch, s, DistInfo()).totals
            for key in ("loss", "kl", "entropy", "ratio_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), (name, seed, key)
            for update_got, update_want in zip(ours.grads, eager.grads, strict=True):
                assert update_got.keys() == update_want.keys()
                for param, grad in update_want.items():
                    assert torch.allclose(update_got[param], grad, atol=1e-6, rtol=1e-5), (name, seed, param)


@pytest.mark.slow
def test_every_pass_the_update_runs_gives_the_eager_values_under_gradient_checkpointing(tiny_tokenizer):
    model = model_with(tiny_tokenizer, checkpointing=True)
    assert_compiled_update_is_the_eager_one(model, tiny_tokenizer, {
        "plain": LogprobPass(share_prompts=False), "shared prompt": LogprobPass(share_prompts=True),
        "fused head": LogprobPass(share_prompts=False, fused_head=True)})


@pytest.mark.slow
def test_a_lora_policy_compiles_to_the_eager_values(tiny_tokenizer):
    model = model_with(tiny_tokenizer, lora=True, checkpointing=True)
    assert_compiled_update_is_the_eager_one(model, tiny_tokenizer, {
        "plain": LogprobPass(share_prompts=False), "packed": LogprobPass(pack=True)})


@pytest.mark.slow
def test_inductor_on_the_cpu_compiles_dynamic_shapes_to_the_eager_values(tiny_tokenizer):
    # the default backend, with the CPU's left-padded masks over two shapes (torch 2.11's C++ code for the
    # padding-mask lookup did not build with dynamic shapes: grpo.models.compiled)
    model = model_with(tiny_tokenizer)
    assert_compiled_update_is_the_eager_one(model, tiny_tokenizer, {"plain": LogprobPass(share_prompts=False)},
                                            CompileSettings())


@pytest.mark.slow
def test_a_compiled_run_trains(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    values = {"model.name_or_path": tiny_model_dir, "model.gradient_checkpointing": True,
              "data.train": "synthetic:seed=1,n=64", "rollout.num_generations": 4,
              "rollout.max_completion_length": 12, "train.prompts_per_step": 2, "train.micro_batch_size": 4,
              "train.max_steps": 3, "train.save_steps": 10, "train.output_dir": out, "train.seed": 0,
              "train.torch_compile": True, "train.torch_compile_backend": "aot_eager", "loss.beta": 0.04,
              "optim.learning_rate": 1e-3, "log.report_to": "[]", "log.progress_bar": False, "log.plots": False,
              "rewards": "[{name: answer_correct}, {name: format_think_answer}]"}
    train(load_config(None, [f"{k}={v}" for k, v in values.items()]))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r[k]) for r in rows for k in ("loss", "kl", "grad_norm", "entropy"))
    assert all(r["skipped_updates"] == 0.0 for r in rows) and rows[-1]["kl"] > 0  # the weights moved


def test_the_eager_forward_is_back_after_an_error(tiny_tokenizer):
    model = model_with(tiny_tokenizer)
    compiled = CompiledDecoder(model, AOT)
    with pytest.raises(RuntimeError, match="boom"), compiled.active():
        assert compiled.module.forward is compiled.forward
        raise RuntimeError("boom")
    assert "forward" not in vars(compiled.module)


def test_an_unknown_backend_is_refused_naming_the_key():
    check_compile(CompileSettings("aot_eager"))
    check_compile(CompileSettings())  # inductor
    with pytest.raises(ConfigError, match="train.torch_compile_backend: 'nope' is not a torch.compile backend"):
        check_compile(CompileSettings("nope"))


@pytest.mark.parametrize("overrides, why", [
    (["train.torch_compile_backend=aot_eager"], "train.torch_compile_backend is 'aot_eager' but train.torch_compile "
                                                "is false"),
    (["train.torch_compile_mode=max-autotune"], "train.torch_compile_mode is 'max-autotune' but"),
    (["train.torch_compile=true", "train.deepspeed=configs/ds_zero2.json"],
     "train.torch_compile cannot be combined with train.deepspeed"),
])
def test_what_compile_cannot_be_combined_with_is_refused(overrides, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, overrides)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_on_cuda_gives_the_eager_update(tiny_tokenizer):
    model = model_with(tiny_tokenizer).cuda()
    compiled = CompiledDecoder(model, CompileSettings())
    batch = random_batch(len(tiny_tokenizer), N=8, Lc=9)
    s = settings_with(max_completion_length=9, logprob_pass=LogprobPass(share_prompts=False))
    ours, eager = CompiledRecording(model, compiled), RecordingLearner(model)
    got, want = (train_on_batch(learner, batch, s, DistInfo()).totals for learner in (ours, eager))
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    for param, grad in eager.grads[0].items():
        assert torch.allclose(ours.grads[0][param], grad, atol=1e-5, rtol=1e-4), param
