"""GSPO as TRL's paper index writes it: sequence-level ratios, no KL, tiny clips, and each generation split into 4
optimizer updates (steps_per_generation=4, gradient_accumulation_steps=1): 8 updates are 2 generations."""

import sys

from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}]}
                             for i in range(16)])


def short(completions, **kwargs):  # varies within a group, so that the updates have advantages to follow
    return [-len(c[0]["content"]) / 40 for c in completions]


args = GRPOConfig(output_dir=OUT, importance_sampling_level="sequence", loss_type="grpo", beta=0.0, epsilon=3e-4,
                  epsilon_high=4e-4, gradient_accumulation_steps=1, steps_per_generation=4,
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=12, max_steps=8,
                  learning_rate=1e-5, logging_steps=2, save_steps=4, use_cpu=True, bf16=False,
                  gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=3)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=short, args=args, train_dataset=dataset, callbacks=[recorder])
trainer.train()
write_report(trainer, recorder)
