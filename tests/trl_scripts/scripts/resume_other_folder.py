"""Train 4 steps in OUT/first saving every 2, then a new trainer writing to OUT resumes from
OUT/first/checkpoint-2 (a checkpoint outside its output_dir) and trains steps 3 and 4 there."""

import sys

from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)}
                             for i in range(32)])


def says_it(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def trainer_for(output_dir, recorder):
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=4, learning_rate=1e-5, logging_steps=1, save_steps=2,
                      use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True,
                      seed=4)
    return GRPOTrainer(model=MODEL, reward_funcs=says_it, args=args, train_dataset=dataset, callbacks=[recorder])


trainer_for(f"{OUT}/first", EventRecorder()).train()
recorder = EventRecorder()
resumed = trainer_for(OUT, recorder)
resumed.train(resume_from_checkpoint=f"{OUT}/first/checkpoint-2")
write_report(resumed, recorder, restored_steps=[e["step"] for e in resumed.state.log_history if "loss" in e])
