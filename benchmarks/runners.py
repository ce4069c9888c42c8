"""One benchmark run of one trainer, in its own process: ``python benchmarks/runners.py ours|trl CASE.json``.

Both trainers get the same model folder, the same prompts file, the same settings and the same torch
thread count. Each writes a JSON result: per-step seconds (and the generation / log-prob /
optimisation split), rewards, peak RSS, and the tokens trained (for FLOP/s).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_ours(case: dict) -> dict:
    from grpo.config import load_config
    from grpo.trainer import train

    out = Path(case["workdir"]) / "ours"
    overrides = {
        "model.name_or_path": case["model"], "model.lora_r": case["lora_r"], "model.lora_alpha": 32,
        "data.train": case["prompts"], "data.shuffle": False, "data.eval": None,
        "rollout.num_generations": case["G"], "rollout.max_completion_length": case["max_completion_length"],
        "rollout.temperature": 1.0, "loss.beta": case["beta"], "loss.loss_type": "grpo",
        "loss.num_iterations": case["num_iterations"], "optim.learning_rate": case["lr"],
        "optim.lr_scheduler_type": "constant", "optim.max_grad_norm": 1.0,
        "train.prompts_per_step": case["P"], "train.micro_batch_size": case["P"] * case["G"],
        "train.max_steps": case["steps"], "train.save_steps": 10_000, "train.output_dir": out,
        "train.overwrite": True, "train.seed": case["seed"], "log.report_to": "[]", "log.progress_bar": False,
        "log.num_samples": 0, "rewards": "[{name: answer_correct}, {name: format_think_answer}]",
    }
    if case["lora_r"]:
        overrides["optim.lora_learning_rate"] = case["lr"]
    train(load_config(None, [f"{k}={'null' if v is None else v}" for k, v in overrides.items()]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    return {
        "step_s": [r["time/step_s"] for r in rows],
        "generate_s": [r.get("time/generate_s", float("nan")) for r in rows],
        "logprobs_s": [r.get("time/logprobs_s", 0.0) + r.get("time/rewards_s", 0.0) for r in rows],
        "train_s": [r["time/train_s"] for r in rows],
        "reward": [r["reward/mean"] for r in rows],
        "completion_length": [r["completion_length/mean"] for r in rows],
    }


def run_trl(case: dict) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.data import load_dataset_source, resolve_system_prompt
    from grpo.rewards import get_reward_function

    system = resolve_system_prompt(None, "think")
    examples = load_dataset_source(case["prompts"])
    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "system", "content": system}, *e.messages], "answer": e.answer} for e in examples])
    tokenizer = AutoTokenizer.from_pretrained(case["model"])
    model = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32)
    peft_config = None
    if case["lora_r"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=case["lora_r"], lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    completions = case["P"] * case["G"]
    config = GRPOConfig(
        output_dir=str(Path(case["workdir"]) / "trl"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=completions, gradient_accumulation_steps=1, num_generations=case["G"],
        max_completion_length=case["max_completion_length"], temperature=1.0, top_p=1.0, top_k=0,
        beta=case["beta"], loss_type="grpo", num_iterations=case["num_iterations"], learning_rate=case["lr"],
        lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=case["steps"] * case["num_iterations"],
        logging_steps=1, save_strategy="no", report_to=[], seed=case["seed"], disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False)
    rewards = [get_reward_function("answer_correct"), get_reward_function("format_think_answer")]
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    phases = {"generate": [], "score": [], "step_end": []}
    generate_owner = trainer.model  # TRL generates with the (unwrapped) training model

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[key].append(time.perf_counter() - t)
        return wrapper

    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "score")
    generate_owner.generate = timed(generate_owner.generate, "generate")

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            phases["step_end"].append(time.perf_counter())

    trainer.add_callback(StepTimer())
    started = time.perf_counter()
    trainer.train()
    # One rollout batch serves num_iterations optimizer steps: a "step" here is one rollout batch.
    mu = case["num_iterations"]
    ends = phases["step_end"][mu - 1::mu]
    step_s = [b - a for a, b in zip([started, *ends[:-1]], ends)]
    generate_s = phases["generate"][: len(step_s)]
    score_s = phases["score"][: len(step_s)]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "step_s": step_s,
        "generate_s": generate_s,
        "logprobs_s": [s - g for s, g in zip(score_s, generate_s)],
        "train_s": [t - s for t, s in zip(step_s, score_s)],
        "reward": [h["reward"] for h in logs][::mu],
    }


def main() -> None:
    which, case_file = sys.argv[1], Path(sys.argv[2])
    case = json.loads(case_file.read_text())
    import torch

    torch.set_num_threads(case["threads"])
    torch.manual_seed(case["seed"])
    result = run_ours(case) if which == "ours" else run_trl(case)
    result["peak_rss_mb"] = peak_rss_mb()
    Path(case["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
