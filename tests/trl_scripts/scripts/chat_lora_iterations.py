"""Chat prompts with a system turn, LoRA, two updates per generation (num_iterations=2), logging every step."""

import sys

from datasets import Dataset
from peft import LoraConfig
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
SYSTEM = "Answer with a number in <answer></answer> tags."
dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": f"What is {i} + {i + 1}?"}],
                              "answer": str(2 * i + 1)} for i in range(16)])


def correct(completions, answer, **kwargs):
    return [1.0 if f"<answer>{a}</answer>" in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [-len(c[0]["content"]) / 64 for c in completions]


args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
                  num_iterations=2, max_steps=4, learning_rate=1e-4, logging_steps=1, save_steps=2, use_cpu=True,
                  bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=1)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=[correct, short], args=args, train_dataset=dataset,
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"),
                      callbacks=[recorder])
trainer.train()
write_report(trainer, recorder)
