"""Helpers shared by the tests of the policy update and the engines (test_policy_update.py, test_ptx.py,
test_critic.py, test_host_syncs.py, ...): a learner that records gradients, a random rollout batch, loss
settings, a counter of would-be host syncs, and a chat-formatted prompt."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import Counter
from dataclasses import replace
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo
from grpo.parallel.learners import UpdateOutcome
from grpo.step.update_inputs import LossSettings
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch

# ---------------------------------------------------------------- the policy update


class RecordingLearner:
    """Runs backward like the torch learner but records the accumulated gradient instead of stepping."""

    def __init__(self, module):
        self.module = module
        self.grads = []

    def accumulating(self, last):
        return nullcontext()

    def backward(self, loss):
        loss.backward()

    def finish_update(self):
        self.grads.append({n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None})
        self.module.zero_grad(set_to_none=True)
        return UpdateOutcome(0.0)

    @property
    def lr(self):
        return 0.0


def random_batch(vocab: int, N: int = 6, Lp: int = 5, Lc: int = 7, seed: int = 0) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, Lc + 1, (N,), generator=gen)
    completion_mask = (torch.arange(Lc)[None] < lengths[:, None]).long()
    prompt_mask = torch.ones(N, Lp, dtype=torch.long)
    prompt_mask[0, :2] = 0  # a left-padded prompt
    logp = -torch.rand(N, Lc, generator=gen)
    return RolloutBatch(
        generation=Generation(
            prompt_ids=torch.randint(3, vocab, (N, Lp), generator=gen), prompt_mask=prompt_mask,
            completion_ids=torch.randint(3, vocab, (N, Lc), generator=gen), completion_mask=completion_mask,
            truncated=torch.zeros(N, dtype=torch.bool), completions=[""] * N),
        rewards=torch.randn(N, generator=gen), reward_parts=torch.randn(N, 1, generator=gen), reward_names=["r"],
        advantages=torch.randn(N, generator=gen), old_logprobs=logp - 0.1, ref_logprobs=logp + 0.2,
        prompts=[""] * (N // 2))


def settings_with(**changes) -> LossSettings:
    base = dict(epsilon=0.2, epsilon_high=None, beta=0.0, loss_type="grpo", max_completion_length=7,
                temperature=0.9, num_iterations=1, micro_batch_size=2, max_grad_norm=None)
    return LossSettings(**{**base, **changes})


# ---------------------------------------------------------------- host syncs

GRPO_DIR = Path(grpo.__file__).parent
SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
            torch.ops.aten.masked_select.default}


def grpo_caller() -> str:
    """The innermost grpo source file on the stack ('' when none): who asked for the sync (called from the
    function that saw the op: its caller's frame is where the search starts)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if GRPO_DIR in path.parents:
            return str(path.relative_to(GRPO_DIR))
        frame = frame.f_back
    return ""


class CountSyncs(TorchDispatchMode):
    """Counts would-be host syncs by the grpo file that caused them."""

    def __init__(self):
        super().__init__()
        self.by_file: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            self.by_file[grpo_caller()] += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- engines


def chat(tokenizer, text):
    """``text`` as a user turn in the tokenizer's chat template, ready for the assistant's answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


# ---------------------------------------------------------------- a vLLM-like engine under `grpo train`


class DriftingEngine:
    """Samples from the policy itself (the HF lean engine) but, like vLLM, "holds its own weights"
    (``update_weights``) and reports ``sampler_logprobs``: the policy's own, plus ``drift`` from the
    ``drift_from_call``-th generate call on (1-based: call k samples step k)."""

    def __init__(self, policy, tokenizer, drift: float = 0.0, drift_from_call: int = 1):
        from grpo.rollout import LeanEngine

        self.inner, self.policy = LeanEngine(policy, tokenizer), policy
        self.drift, self.drift_from_call = drift, drift_from_call
        self.calls, self.pushed = 0, []

    def generate(self, prompts, params, seed=None):
        from grpo.step.experience import generation_logprobs

        self.calls += 1
        gen = self.inner.generate(prompts, params, seed=seed)
        own = generation_logprobs(self.policy, gen, params.temperature, 64).float().cpu()  # [N, Lc]
        drift = self.drift if self.calls >= self.drift_from_call else 0.0
        return replace(gen, sampler_logprobs=(own + drift) * gen.completion_mask)

    def update_weights(self, loaded) -> None:
        self.pushed.append(loaded.version)


def run_train(monkeypatch, model_dir, out, engine_box: dict, *extra: str) -> int:
    """`grpo train` (the CLI, exit status and all) with the run's engine replaced by a DriftingEngine."""
    import grpo.training.colocated
    from grpo.cli import main

    def build(cfg, policy, tokenizer):
        engine_box["engine"] = DriftingEngine(policy, tokenizer, **engine_box.get("kwargs", {}))
        return engine_box["engine"]

    monkeypatch.setattr(grpo.training.colocated, "build_engine", build)
    return main(["train", f"model.name_or_path={model_dir}", "data.train=synthetic:seed=1,n=64",
                 "rollout.num_generations=4", "rollout.max_completion_length=8", "train.prompts_per_step=2",
                 "train.micro_batch_size=8", "train.save_steps=100", f"train.output_dir={out}",
                 "loss.beta=0", "log.report_to=[]", "log.progress_bar=false", "log.plots=false", *extra])


def logged(out) -> list[dict]:
    """The run's metrics.jsonl rows."""
    from grpo.run.tracking import read_metrics

    return read_metrics(out / "metrics.jsonl")


def run_spawned_ranks(target, world: int, port: int, out: str, timeout_s: float = 300) -> None:
    """``target(rank, world, port, out)`` in ``world`` spawned processes (gloo ranks); fails naming the exit codes
    when one fails or is still running after ``timeout_s`` (a hang: it is killed)."""
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=target, args=(rank, world, port, out), daemon=True) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout_s)
    codes = [process.exitcode for process in ranks]
    for process in ranks:
        if process.is_alive():
            os.kill(process.pid, 9)
    assert codes == [0] * world, f"ranks exited with {codes} (None: still running after {timeout_s} s, a hang)"
