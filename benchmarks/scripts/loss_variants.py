"""TRL 1.16's loss-variant recipes as its docs and paper index write them, one import line apart between TRL and grpo:

    python benchmarks/scripts/loss_variants.py --recipe gspo            # grpo
    python benchmarks/scripts/loss_variants.py --recipe gspo --trl      # TRL

- gspo: sequence-level ratios, no KL, clips 3e-4 / 4e-4, steps_per_generation=4 (4 optimizer updates a generation);
- dapo-80-20: DAPO's loss with clip-higher and the 80/20 high-entropy mask (top_entropy_quantile=0.2);
- cispo: CISPO's capped ratio (epsilon_high=5.0) with the adaptive entropy bonus and the off-policy mask;
- sapo: SAPO's soft gate over two rewards aggregated as GDPO (normalize_then_sum), with a KL term;
- no-save: save_strategy="no" (no checkpoint) and logging every step, TRL's quickstart defaults otherwise;
- sync-ref: TR-DPO's moving reference (sync_ref_model, mixed 0.6 toward the policy every 2 steps) with a KL term;
- optimizers: GRPOTrainer(optimizers=(AdamW, LambdaLR)) built by the script on the model it loads.

Chat prompts from grpo's synthetic word problems (no download); timed by benchmarks/api_vs_trl.py.
"""

import argparse
import re

from datasets import Dataset

RECIPES = {
    "gspo": dict(importance_sampling_level="sequence", loss_type="grpo", beta=0.0, epsilon=3e-4, epsilon_high=4e-4,
                 gradient_accumulation_steps=1, steps_per_generation=4),
    "dapo-80-20": dict(loss_type="dapo", epsilon_high=0.28, beta=0.0, top_entropy_quantile=0.2,
                       mask_truncated_completions=False),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0, beta=0.0, entropy_coef=0.01, use_adaptive_entropy=True,
                  off_policy_mask_threshold=0.5, num_iterations=2),
    "sapo": dict(loss_type="sapo", beta=0.04, multi_objective_aggregation="normalize_then_sum"),
    "no-save": dict(save_strategy="no"),
    "sync-ref": dict(beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=2),
    "optimizers": dict(),
}


def make_dataset(rows: int) -> Dataset:
    from grpo.data.synthetic import generate_problems  # GSM8K-style word problems, no download

    return Dataset.from_list([{"prompt": [{"role": "user", "content": e.question}], "ground_truth": e.answer}
                              for e in generate_problems(rows, seed=13, difficulty="demo")])


def reward_len(completions, **kwargs):
    """Prefer completions of about 40 characters."""
    return [-abs(40 - len(c[0]["content"])) / 40 for c in completions]


def reward_answer(completions, ground_truth, **kwargs):
    """1 when the last number of the completion is the answer."""
    found = [re.findall(r"-?\d+", c[0]["content"]) for c in completions]
    return [1.0 if numbers and numbers[-1] == answer else 0.0 for numbers, answer in zip(found, ground_truth)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl", action="store_true", help="run TRL's GRPOTrainer instead of grpo's")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="gspo")
    parser.add_argument("--model", default="assets/tiny-math")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="outputs/loss-variants")
    args = parser.parse_args()

    if args.trl:
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo import GRPOConfig, GRPOTrainer  # the one line that changes

    training_args = GRPOConfig(output_dir=args.output_dir, per_device_train_batch_size=8, num_generations=8,
                               max_completion_length=32, max_steps=args.max_steps, logging_steps=1, use_cpu=True,
                               report_to="none", **RECIPES[args.recipe])
    rewards = [reward_len, reward_answer] if args.recipe == "sapo" else [reward_answer, reward_len]
    model, optimizers = args.model, (None, None)
    if args.recipe == "optimizers":  # the optimizer must hold the model's parameters: the script loads the model
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.0)
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 100))
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=training_args, train_dataset=make_dataset(256),
                          optimizers=optimizers)
    trainer.train()
    for entry in trainer.state.log_history:
        print({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in entry.items()})


if __name__ == "__main__":
    main()
