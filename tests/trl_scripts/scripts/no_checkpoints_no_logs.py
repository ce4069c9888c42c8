"""save_strategy="no" and logging_strategy="no" over a 3-step run evaluated every 2 steps: no checkpoint, no
training log entry (the steps merge into the summary), the evaluations still logged."""

import sys

from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]


def rows(start, n):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "answer": str(i + 2)}
            for i in range(start, start + n)]


def correct(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=3, learning_rate=1e-5, logging_strategy="no", save_strategy="no", eval_strategy="steps",
                  eval_steps=2, per_device_eval_batch_size=8, use_cpu=True, bf16=False,
                  gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=3)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=correct, args=args, train_dataset=Dataset.from_list(rows(0, 24)),
                      eval_dataset=Dataset.from_list(rows(100, 4)), callbacks=[recorder])
trainer.train()
write_report(trainer, recorder)
