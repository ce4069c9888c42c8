"""TRL's quickstart shape: plain-text prompts (no chat template), the model named by its path, rewards on the
completion strings. Written as a TRL 1.16 user writes it; only the import line differs between TRL and grpo:

    python benchmarks/scripts/text_prompts.py            # grpo
    python benchmarks/scripts/text_prompts.py --trl      # TRL

The questions are grpo's synthetic word problems (no download); timed by benchmarks/api_vs_trl.py.
"""

import argparse
import re

from datasets import Dataset


def make_dataset(rows: int) -> Dataset:
    from grpo.data.synthetic import generate_problems  # GSM8K-style word problems, no download

    return Dataset.from_list([{"prompt": f"Question: {e.question}\nAnswer:", "ground_truth": e.answer}
                              for e in generate_problems(rows, seed=11, difficulty="demo")])


def reward_len(completions, **kwargs):
    """Prefer completions of about 20 characters."""
    return [-abs(20 - len(completion)) / 20 for completion in completions]


def reward_answer(completions, ground_truth, **kwargs):
    """1 when the first number of the completion is the answer."""
    rewards = []
    for completion, answer in zip(completions, ground_truth):
        numbers = re.findall(r"-?\d+", completion)
        rewards.append(1.0 if numbers and numbers[0] == answer else 0.0)
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl", action="store_true", help="run TRL's GRPOTrainer instead of grpo's")
    parser.add_argument("--model", default="assets/tiny-math")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--output-dir", default="outputs/text-prompts")
    args = parser.parse_args()

    if args.trl:
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo import GRPOConfig, GRPOTrainer  # the one line that changes

    training_args = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=32,
        max_steps=args.max_steps,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=[reward_len, reward_answer],
        args=training_args,
        train_dataset=make_dataset(256),
    )
    trainer.train()
    for entry in trainer.state.log_history:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})


if __name__ == "__main__":
    main()
