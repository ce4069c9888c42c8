"""One benchmark run of one trainer, in its own process: ``python benchmarks/runners.py ours|trl|plain CASE.json``.

Both trainers get the same model folder, the same prompts file, the same settings (``harness.make_case``)
and the same torch thread count. Each writes a JSON result with one value per step (a step is one
rollout batch: generation, rewards, log-probs, the update):

- ``step_s``: the whole step. grpo: its ``time/step_s`` metric (loop start to after the update);
  TRL: between consecutive ``on_step_end`` callbacks (the first from the start of ``train()``).
- ``generate_s``: prompts rendered and tokenized, completions sampled and decoded. grpo: its
  ``time/generate_s``; TRL: ``GRPOTrainer._generate`` (tokenize, ``model.generate``, decode).
- ``ref_logprobs_s``: log-probs without gradients before the update (the reference's, plus the old
  policy's where ``num_iterations`` > 1 needs them). grpo: ``time/rollout_s`` minus generation and
  rewards (``rank_experience`` is wrapped to wait for the GPU before it returns, so the reference's
  queued kernels count here, not in the update); TRL: the ``_get_per_token_logps_and_entropies``
  calls made inside ``_generate_and_score_completions``.
- ``logprobs_s``: everything of the rollout after generation (rewards, log-probs, advantages, TRL's
  padding and metrics); ``train_s``: the update (grpo: ``time/train_s``, i.e. ``train_on_batch``;
  TRL: the step minus ``_generate_and_score_completions``: its forward/backward micro-batches,
  clipping, optimizer and scheduler steps).
- ``reward``, ``completion_length`` (mean completion tokens), ``peak_rss_mb`` and, on CUDA,
  ``peak_gpu_mb`` (``torch.cuda.max_memory_allocated`` of this process).

Every timer waits for the GPU (``torch.cuda.synchronize``) where the phase could leave kernels queued.

``plain`` is no trainer: the floor an update is measured against (``run_plain``: a plain forward+backward
loop over the same tokens), ``train_s`` only. With ``profile_update`` (CUDA), grpo and plain run two more
updates under ``torch.profiler`` (left out of the timings): ``update_gpu_busy`` is the share of the first's
seconds the GPU ran kernels (``profiled``); the second's operator tables (``profiled_ops``) say where the
time goes.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

# --vllm: the share of the GPU each trainer's colocated vLLM reserves (weights + KV cache), the rest trains.
VLLM_GPU_SHARE = 0.3


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def sync(device: str) -> None:
    """Wait for the GPU's queued work, so that a timer stopped next counts it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def busy_fraction(intervals: list[tuple[float, float]], wall: float) -> float:
    """The share of ``wall`` covered by the union of ``[start, end)`` intervals (the same unit): how busy
    a GPU was, from its kernels' intervals (kernels on several streams may overlap: counted once)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / wall if wall > 0 else float("nan")


PROFILED_UPDATES = 2  # with profile_update: the updates run after the timed ones (see profile_update)


def profiled(fn):
    """Run ``fn()`` once under ``torch.profiler`` recording only the GPU's activity (kernels, copies):
    (its result, {"update_profiled_s": its seconds, "update_gpu_busy": the share of them the GPU was
    busy, "update_kernels": kernels and copies launched}). The profiler adds a little host work per
    launch, so the share is a lower bound of the unprofiled one."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    # kernel times are microseconds from the profiler's start, which is just before `started`
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return result, {"update_profiled_s": seconds, "update_gpu_busy": busy_fraction(kernels, seconds * 1e6),
                    "update_kernels": len(kernels)}


def profiled_ops(fn, rows: int = 30):
    """Run ``fn()`` once under ``torch.profiler`` with the host's and the GPU's activity: (its result,
    {"update_top_ops_host": the operators by self host time, "update_top_ops_gpu": by self GPU time},
    ``rows`` each, as torch's tables): where an update's time goes, from the benchmark's own run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()  # (without one, the host's table alone: how a CPU test runs this)
    if on_gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        result = fn()
        if on_gpu:
            torch.cuda.synchronize()
    table = prof.key_averages()
    found = {"update_top_ops_host": table.table(sort_by="self_cpu_time_total", row_limit=rows)}
    if on_gpu:
        found["update_top_ops_gpu"] = table.table(sort_by="self_device_time_total", row_limit=rows)
    return result, found


def profile_update(fn, extra: int) -> tuple[object, dict]:
    """The ``extra``-th update after the timed ones (1-based): the first is timed for the GPU's busy share
    (``profiled``), the second for its operators (``profiled_ops``, whose host-side tracing would lower
    the share)."""
    return profiled(fn) if extra == 1 else profiled_ops(fn)


def ours_config(case: dict):
    """grpo's run config for ``case`` (what ``run_ours`` trains, what ``run_plain`` loads its model with)."""
    from grpo.config import load_config

    out = Path(case["workdir"]) / "ours"
    overrides = {
        "model.name_or_path": case["model"], "model.lora_r": case["lora_r"], "model.lora_alpha": 32,
        "model.gradient_checkpointing": case["gradient_checkpointing"], "model.bf16": case["bf16"],
        "model.attn_implementation": case["attn_implementation"], "train.device": case["device"],
        "data.train": case["prompts"], "data.shuffle": False, "data.eval": None,
        "rollout.num_generations": case["G"], "rollout.max_completion_length": case["max_completion_length"],
        "rollout.temperature": 1.0, "rollout.engine": case.get("engine", "auto"), "loss.beta": case["beta"],
        "loss.loss_type": "grpo",
        "loss.num_iterations": case["num_iterations"], "optim.learning_rate": case["lr"],
        "optim.lr_scheduler_type": "constant", "optim.max_grad_norm": 1.0,
        "train.prompts_per_step": case["P"], "train.micro_batch_size": case["micro_batch_size"],
        "train.max_steps": case["steps"], "train.save_steps": 10_000, "train.output_dir": out,
        "train.overwrite": True, "train.seed": case["seed"], "log.report_to": "[]", "log.progress_bar": False,
        "log.num_samples": 0, "rewards": "[{name: answer_correct}, {name: format_think_answer}]",
    }
    if case["lora_r"]:
        overrides["optim.lora_learning_rate"] = case["lr"]
    if case.get("vllm"):  # the same share of the GPU as TRL's vLLM below; the off-policy guard at its default
        overrides.update({"rollout.engine": "vllm", "rollout.vllm_gpu_memory_utilization": VLLM_GPU_SHARE,
                          "rollout.vllm_dtype": "bfloat16" if case["bf16"] else "float32"})
    if case.get("profile_update"):  # more steps, whose updates are profiled and left out of the timings
        overrides["train.max_steps"] = case["steps"] + PROFILED_UPDATES
    if case.get("sdpa_backends", "auto") != "auto":  # the attention backends, instead of torch's own choice
        overrides["model.sdpa_backends"] = case["sdpa_backends"]
    if case.get("shared_prompt_pass", "auto") != "auto":  # on|off: YAML booleans, as a user writes them
        overrides["train.shared_prompt_pass"] = case["shared_prompt_pass"]
    if case.get("column_bucket") is not None:
        overrides["train.column_bucket"] = case["column_bucket"]
    overrides.update(case.get("grpo_set") or {})  # --grpo-set KEY=VALUE: any other config key, last
    return load_config(None, [f"{k}={'null' if v is None else v}" for k, v in overrides.items()])


def run_ours(case: dict) -> dict:
    import grpo.training.colocated
    import grpo.training.loop

    cfg = ours_config(case)
    rank_experience = grpo.training.colocated.rank_experience

    def rank_experience_synced(*args, **kwargs):
        made = rank_experience(*args, **kwargs)
        sync(case["device"])
        return made

    grpo.training.colocated.rank_experience = rank_experience_synced  # the loop's rollout_done then follows the GPU
    profile = {}
    if case.get("profile_update"):
        train_on_batch, calls = grpo.training.loop.train_on_batch, [0]

        def train_on_batch_profiling_the_extra(*args, **kwargs):
            calls[0] += 1
            if calls[0] <= case["steps"]:
                return train_on_batch(*args, **kwargs)
            stats, found = profile_update(lambda: train_on_batch(*args, **kwargs), calls[0] - case["steps"])
            profile.update(found)
            return stats

        grpo.training.loop.train_on_batch = train_on_batch_profiling_the_extra
    grpo.training.colocated.train(cfg)
    lines = (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    rows = [row for line, row in zip(lines, logged) if "loss" in line][:case["steps"]]
    evaluations = [r["time/eval_s"] for r in logged if "time/eval_s" in r]  # with data.eval: start, end
    moe = {key.replace("/", "_"): [r[key] for r in rows] for key in ("moe/aux_loss", "moe/routing_mismatch")
           if rows and all(key in r for r in rows)}  # a MoE policy's router loss; with routing replay, the mismatch
    return {**profile, **moe, **({"eval_s": evaluations} if evaluations else {}),
        "step_s": [r["time/step_s"] for r in rows],
        "generate_s": [r["time/generate_s"] for r in rows],
        "ref_logprobs_s": [r["time/rollout_s"] - r["time/generate_s"] - r["time/rewards_s"] for r in rows],
        "logprobs_s": [r["time/rollout_s"] - r["time/generate_s"] for r in rows],
        "train_s": [r["time/train_s"] for r in rows],
        "reward": [r["reward/mean"] for r in rows],
        "completion_length": [r["completion_length/mean"] for r in rows],
    }


def run_plain(case: dict) -> dict:
    """The floor an update is held to: a plain forward+backward loop over the same tokens as a grpo step
    (each of the P prompts G times, with ``max_completion_length`` completion tokens: what a random model
    samples), the same model setup (grpo's ``load_policy``: fp32 weights under bf16 autocast, or LoRA over
    a bf16 base; checkpointing as the case says), micro-batches of the same size, every row its own full
    sequence (no shared prompt pass), logits for the completion positions only, a log-softmax-and-gather
    in float32, then the same clipping and AdamW step. Tokens are on the device before the clock starts.
    ``train_s``: one value per update (a step's worth of micro-batches and the optimizer step)."""
    import torch

    from grpo.data import load_dataset_source, resolve_system_prompt
    from grpo.models.loading import compute_context, load_policy, load_tokenizer, resolve_device, uses_autocast
    from grpo.step.experience import render_prompts
    from grpo.step.logprobs import position_ids_from_mask
    from grpo.parallel.optim import build_optimizer

    cfg = ours_config(case)
    device = resolve_device(cfg.train.device)
    policy = load_policy(cfg.model, device, master_weights=uses_autocast(cfg.model, False))
    compute = compute_context(cfg.model, device, False)
    optimizer = build_optimizer(policy, cfg.optim, lora=cfg.model.lora_r > 0)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    tokenizer = load_tokenizer(case["model"])
    P, G, L, micro = case["P"], case["G"], case["max_completion_length"], case["micro_batch_size"]
    updates = case["steps"] + (PROFILED_UPDATES if case.get("profile_update") else 0)
    texts = render_prompts(tokenizer, load_dataset_source(case["prompts"])[:P * updates],
                           resolve_system_prompt(None, "think"), 10**6)
    generator = torch.Generator().manual_seed(case["seed"])
    batches, prompt_tokens = [], []
    for step in range(updates):  # [micro, Lp + L] ids, mask and positions per micro-batch, on the device
        # the profiled updates after the timed ones reuse the prompts from the start: the prompts file holds
        # P x steps (gpu_vs_trl.py writes what the trainers step through), and only their shapes matter here
        rows = [texts[(step * P + r // G) % len(texts)] for r in range(P * G)]
        micro_batches = []
        for start in range(0, P * G, micro):
            prompt = tokenizer(rows[start:start + micro], padding=True, add_special_tokens=False, return_tensors="pt")
            completion = torch.randint(len(tokenizer), (prompt.input_ids.shape[0], L), generator=generator)
            mask = torch.cat([prompt.attention_mask, torch.ones_like(completion)], 1)
            if step < case["steps"]:  # the timed updates' tokens (what their TFLOP/s count)
                prompt_tokens.extend(prompt.attention_mask.sum(1).tolist())
            micro_batches.append(tuple(t.to(device) for t in (torch.cat([prompt.input_ids, completion], 1), mask,
                                                              position_ids_from_mask(mask), completion)))
        batches.append(micro_batches)

    def update(micro_batches) -> None:
        # one compute context over the update, as grpo's trainer holds its own: autocast's bf16 copies of the
        # weights are cast once per update, not once per micro-batch (and cleared after the step, as there)
        with compute:
            for ids, mask, positions, completion in micro_batches:
                logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions,
                                logits_to_keep=L + 1).logits[:, :-1]  # [b, L, V]: position t predicts token t + 1
                logprobs = torch.log_softmax(logits.float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
                (-logprobs.mean() * ids.shape[0] / (P * G)).backward()
            torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.max_grad_norm)
            optimizer.step()
            torch.clear_autocast_cache()
        optimizer.zero_grad(set_to_none=True)

    train_s, result = [], {}
    for micro_batches in batches[:case["steps"]]:
        started = time.perf_counter()
        update(micro_batches)
        sync(case["device"])
        train_s.append(time.perf_counter() - started)
    if case.get("profile_update"):
        for extra in range(1, PROFILED_UPDATES + 1):
            result.update(profile_update(lambda: update(batches[case["steps"] + extra - 1]), extra)[1])
    return {**result, "train_s": train_s, "completion_tokens": L,
            "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens)}


def run_trl(case: dict) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.data import load_dataset_source, resolve_system_prompt
    from grpo.rewards import get_reward_function

    device = case["device"]
    system = resolve_system_prompt(None, "think")
    examples = load_dataset_source(case["prompts"])
    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "system", "content": system}, *e.messages], "answer": e.answer} for e in examples])
    tokenizer = AutoTokenizer.from_pretrained(case["model"])
    load_kwargs = {"attn_implementation": case["attn_implementation"]} if case["attn_implementation"] else {}
    model = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32, **load_kwargs)
    peft_config = None
    if case["lora_r"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=case["lora_r"], lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    completions = case["P"] * case["G"]
    micro = case["micro_batch_size"]
    # TRL 1.16 (GRPOConfig.__post_init__): steps_per_generation defaults to gradient_accumulation_steps and
    # generation_batch_size to per_device_train_batch_size x steps_per_generation, so P x G completions are
    # generated at once and trained in micro-batches of `micro` rows: one optimizer step per rollout batch.
    config = GRPOConfig(
        output_dir=str(Path(case["workdir"]) / "trl"), use_cpu=not device.startswith("cuda"), bf16=case["bf16"],
        fp16=False, per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        # TRL's own default is gradient_checkpointing=True: say it every time so both sides match
        gradient_checkpointing=case["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False} if case["gradient_checkpointing"] else None,
        num_generations=case["G"], max_completion_length=case["max_completion_length"], temperature=1.0, top_p=1.0,
        top_k=0, beta=case["beta"], loss_type="grpo", num_iterations=case["num_iterations"], learning_rate=case["lr"],
        lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=case["steps"] * case["num_iterations"],
        logging_steps=1, save_strategy="no", report_to=[], seed=case["seed"], disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False,
        **(dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=VLLM_GPU_SHARE)
           if case.get("vllm") else dict(use_vllm=False)))
    rewards = [get_reward_function("answer_correct"), get_reward_function("format_think_answer")]
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    phases = {"generate": [], "score": [], "ref": [], "step_end": []}
    in_scoring = [False]

    def timed(fn, key, *, only_while_scoring=False):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if not only_while_scoring or in_scoring[0]:
                    sync(device)
                    phases[key].append(time.perf_counter() - started)
        return wrapper

    score = timed(trainer._generate_and_score_completions, "score")

    def scoring(*args, **kwargs):
        in_scoring[0] = True
        try:
            return score(*args, **kwargs)
        finally:
            in_scoring[0] = False

    # Instance attributes: TRL calls these through `self.`, so the wrappers see every call.
    trainer._generate_and_score_completions = scoring
    trainer._generate = timed(trainer._generate, "generate")
    trainer._get_per_token_logps_and_entropies = timed(trainer._get_per_token_logps_and_entropies, "ref",
                                                       only_while_scoring=True)

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            phases["step_end"].append(time.perf_counter())

    trainer.add_callback(StepTimer())
    started = time.perf_counter()
    trainer.train()
    # One rollout batch serves num_iterations optimizer steps: a "step" here is one rollout batch.
    mu = case["num_iterations"]
    ends = phases["step_end"][mu - 1::mu]
    step_s = [b - a for a, b in zip([started, *ends[:-1]], ends)]
    steps = len(step_s)
    ref_per_step = len(phases["ref"]) // max(len(phases["score"]), 1)  # 1, or 2 with old log-probs
    ref_s = [sum(phases["ref"][i * ref_per_step:(i + 1) * ref_per_step]) for i in range(steps)]
    generate_s, score_s = phases["generate"][:steps], phases["score"][:steps]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "step_s": step_s,
        "generate_s": generate_s,
        "ref_logprobs_s": ref_s,
        "logprobs_s": [s - g for s, g in zip(score_s, generate_s)],
        "train_s": [t - s for t, s in zip(step_s, score_s)],
        "reward": [h["reward"] for h in logs][::mu],
        "completion_length": [h["completions/mean_length"] for h in logs][::mu],
    }


def main() -> None:
    which, case_file = sys.argv[1], Path(sys.argv[2])
    case = json.loads(case_file.read_text())
    import torch

    torch.set_num_threads(case["threads"])
    torch.manual_seed(case["seed"])
    on_gpu = case["device"].startswith("cuda")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    result = {"ours": run_ours, "trl": run_trl, "plain": run_plain}[which](case)
    result["peak_rss_mb"] = peak_rss_mb()
    if on_gpu:
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    Path(case["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
