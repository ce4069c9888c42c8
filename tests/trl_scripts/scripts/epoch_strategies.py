"""Two epochs of 6 prompts (3 steps each) logged, evaluated and checkpointed at each epoch's end, the best
checkpoint by metric_for_best_model loaded into the model at the end (load_best_model_at_end)."""

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
                  num_train_epochs=2, learning_rate=1e-5, logging_strategy="epoch", save_strategy="epoch",
                  eval_strategy="epoch", per_device_eval_batch_size=8, load_best_model_at_end=True,
                  metric_for_best_model="reward", use_cpu=True, bf16=False, gradient_checkpointing=False,
                  report_to="none", disable_tqdm=True, seed=3)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=correct, args=args, train_dataset=Dataset.from_list(rows(0, 6)),
                      eval_dataset=Dataset.from_list(rows(100, 4)), callbacks=[recorder])
trainer.train()
state = trainer.state  # which checkpoint is best differs (TRL's reward is of samples, grpo's of greedy answers)
write_report(trainer, recorder,
             best_recorded=[state.best_global_step in (3, 6),
                            state.best_model_checkpoint in (f"{OUT}/checkpoint-3", f"{OUT}/checkpoint-6")])
