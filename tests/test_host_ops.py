"""Host work of an update, counted: the operators grpo's update dispatches against a plain forward+
backward+step loop over the same rows (issue 15: on the H100 the update was host-bound, GPU busy 35%).

Every dispatched aten operator costs host time whatever the device, so the count is a device-independent
measure of it. grpo's update may add a constant (its loss, statistics, the log-prob gather), but nothing
per layer or per parameter: a Python loop over parameters (clipping, statistics) or a per-layer hook
would grow with depth, and this test compares the growth from 1 to 3 layers exactly.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from step_helpers import random_batch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo.step.logprobs
from grpo.models.tiny import build_qwen2
from grpo.step.logprob_pass import LogprobPass
from grpo.step.logprobs import position_ids_from_mask
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import LossSettings
from grpo.parallel.distributed import DistInfo
from grpo.parallel.learners import TorchLearner

N, LP, LC = 8, 6, 7  # two groups of 4 sharing their prompt


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def model(tokenizer, layers: int, lora: bool):
    policy = build_qwen2(tokenizer, hidden_size=32, num_layers=layers, seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        policy = get_peft_model(policy, lora_config)
    return policy.train()


def batch(tokenizer):
    made = random_batch(len(tokenizer), N=N, Lp=LP, Lc=LC)
    gen = made.generation
    for t in (gen.prompt_ids, gen.prompt_mask):
        t[:] = t[::4].repeat_interleave(4, 0)
    gen.completion_mask[:] = 1
    return made


def counted(fn) -> int:
    fn()  # warm-up: AdamW's states exist from here on, as in every update after the first
    counter = CountOps()
    with counter:
        fn()
    return sum(counter.ops.values())


def grpo_update_ops(tokenizer, layers: int, lora: bool, share_prompts: bool | None = None) -> int:
    """Operators of one update; ``share_prompts`` as train.shared_prompt_pass (None: the CPU's default, shared)."""
    policy = model(tokenizer, layers, lora)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    learner = TorchLearner(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), 1.0)
    settings = LossSettings(epsilon=0.2, epsilon_high=None, beta=0.04, loss_type="grpo", max_completion_length=LC,
                            temperature=1.0, num_iterations=1, micro_batch_size=N, max_grad_norm=1.0,
                            logprob_pass=LogprobPass(share_prompts=share_prompts))
    rollout = batch(tokenizer)
    return counted(lambda: train_on_batch(learner, rollout, settings, DistInfo()).totals)


def plain_update_ops(tokenizer, layers: int, lora: bool) -> int:
    policy = model(tokenizer, layers, lora)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = batch(tokenizer).generation
    ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    positions = position_ids_from_mask(mask)

    def update():
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                        logits_to_keep=LC + 1).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, gen.completion_ids.unsqueeze(-1)).squeeze(-1)
        (-logprobs.mean()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return counted(update)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_update_adds_no_host_work_per_layer_over_a_plain_loop(tiny_tokenizer, lora):
    # the plain pass (train.shared_prompt_pass: false), as the loop runs
    grpo_ops = {layers: grpo_update_ops(tiny_tokenizer, layers, lora, share_prompts=False) for layers in (1, 3)}
    plain_ops = {layers: plain_update_ops(tiny_tokenizer, layers, lora) for layers in (1, 3)}
    # two more layers (and their parameters): exactly the plain loop's extra operators
    assert grpo_ops[3] - grpo_ops[1] == plain_ops[3] - plain_ops[1], (grpo_ops, plain_ops)
    # and a constant beside them: the clipped surrogate, the KL, the statistics, the log-prob gather
    # (on the CPU a loop over the micro-batch's 8 rows; measured 394-442 operators at 16 rows)
    assert 0 < grpo_ops[1] - plain_ops[1] < 500, (grpo_ops, plain_ops)


def test_shared_prompt_pass_is_a_second_forward(tiny_tokenizer):
    """What the shared prompt pass costs the host: a prompt forward (and its backward) beside the
    completions', i.e. about 1.7x the plain update's operators at 28 layers (measured 18006 vs 10616 for
    full fine-tuning, 27291 vs 15529 for LoRA, 16 rows). It saves the prompts' FLOPs (G-1 of G copies);
    which wins on a GPU is train.shared_prompt_pass's to-be-measured CUDA default (docs/device-choices.md)."""
    shared = {layers: grpo_update_ops(tiny_tokenizer, layers, False) for layers in (1, 3)}
    plain = {layers: grpo_update_ops(tiny_tokenizer, layers, False, share_prompts=False) for layers in (1, 3)}
    per_layer_shared, per_layer_plain = (shared[3] - shared[1]) / 2, (plain[3] - plain[1]) / 2
    assert 1.5 < per_layer_shared / per_layer_plain < 2.5, (shared, plain)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reference_pass_adds_no_host_work_per_layer_over_a_plain_forward(tiny_tokenizer, lora):
    """The no-grad log-prob passes (reference, old policy) against one plain forward over the same rows."""
    gen = batch(tiny_tokenizer).generation
    ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    positions = position_ids_from_mask(mask)
    grpo_ops, plain_ops = {}, {}
    for layers in (1, 3):
        policy = model(tiny_tokenizer, layers, lora)
        with torch.no_grad():
            grpo_ops[layers] = counted(lambda: grpo.step.logprobs.completion_logprobs(
                policy, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, 1.0, N,
                share_prompts=False))
            plain_ops[layers] = counted(lambda: torch.log_softmax(policy(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                logits_to_keep=LC + 1).logits[:, :-1].float(), -1).gather(-1, gen.completion_ids.unsqueeze(-1)))
    assert grpo_ops[3] - grpo_ops[1] == plain_ops[3] - plain_ops[1], (grpo_ops, plain_ops)
    assert 0 <= grpo_ops[1] - plain_ops[1] < 300, (grpo_ops, plain_ops)
