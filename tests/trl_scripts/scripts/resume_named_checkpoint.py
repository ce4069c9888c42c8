"""Train 4 steps saving every 2, then resume a new trainer from checkpoint-2 by name; then a missing path."""

import sys

from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)}
                             for i in range(32)])


def says_it(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def trainer_for(recorder):
    args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      max_steps=4, learning_rate=1e-5, logging_steps=1, save_steps=2, use_cpu=True, bf16=False,
                      gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=4)
    return GRPOTrainer(model=MODEL, reward_funcs=says_it, args=args, train_dataset=dataset, callbacks=[recorder])


trainer_for(EventRecorder()).train()
recorder = EventRecorder()
resumed = trainer_for(recorder)
resumed.train(resume_from_checkpoint=f"{OUT}/checkpoint-2")
try:
    trainer_for(EventRecorder()).train(resume_from_checkpoint=f"{OUT}/checkpoint-99")
    missing = None
except Exception as error:  # noqa: BLE001 (the report compares the error's type)
    missing = type(error).__name__
write_report(resumed, recorder, missing_checkpoint_error=missing)
