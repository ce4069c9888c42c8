"""CISPO as TRL's docs configure it (loss_type="cispo", epsilon_high the cap on the ratio, e.g. ScaleRL's 5.0), with
the 80/20 high-entropy mask, DeepSeek-V3.2's off-policy sequence mask and Skywork-OR1's adaptive entropy bonus, two
passes per generation so the ratio moves."""

import sys

from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}]}
                             for i in range(16)])


def short(completions, **kwargs):  # varies within a group, so that the updates have advantages to follow
    return [-len(c[0]["content"]) / 40 for c in completions]


args = GRPOConfig(output_dir=OUT, loss_type="cispo", epsilon_high=5.0, beta=0.0, num_iterations=2,
                  top_entropy_quantile=0.2, off_policy_mask_threshold=0.5, entropy_coef=0.01,
                  use_adaptive_entropy=True, entropy_target=100.0, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=12, max_steps=4, learning_rate=1e-5, logging_steps=1, save_steps=4,
                  use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=3)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=short, args=args, train_dataset=dataset, callbacks=[recorder])
trainer.train()
write_report(trainer, recorder)
