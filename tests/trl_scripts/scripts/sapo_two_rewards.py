"""SAPO (loss_type="sapo", its soft gate's temperatures) with two reward functions aggregated as GDPO does
(multi_objective_aggregation="normalize_then_sum": each reward normalised in its group before the weighted sum) and
TRL's delta-free clipped defaults otherwise; a KL term to the base policy."""

import sys

from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} times 2?"}]} for i in range(16)])


def short(completions, **kwargs):
    return [-len(c[0]["content"]) / 40 for c in completions]


def has_digit(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in c[0]["content"])) for c in completions]


args = GRPOConfig(output_dir=OUT, loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, beta=0.04,
                  multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5],
                  per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                  max_completion_length=12, max_steps=4, learning_rate=1e-5, logging_steps=2, save_steps=4,
                  use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=3)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=[short, has_digit], args=args, train_dataset=dataset,
                      callbacks=[recorder])
trainer.train()
write_report(trainer, recorder)
