"""Text prompts (no chat template), full fine-tuning, a KL term, gradient accumulation, logging every 2 steps."""

import sys

from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": f"Question: what is {i} times 3?\nAnswer:"} for i in range(16)])


def has_digit(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                  max_completion_length=12, max_steps=4, beta=0.04, learning_rate=1e-5, logging_steps=2,
                  save_steps=4, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
                  disable_tqdm=True, seed=2)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=has_digit, args=args, train_dataset=dataset, callbacks=[recorder])
trainer.train()
write_report(trainer, recorder)
