"""A dict of eval sets evaluated every 2 steps of a 4-step run, the best checkpoint tracked by
metric_for_best_model, then trainer.evaluate() on the dict."""

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


args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
                  max_steps=4, learning_rate=1e-5, logging_steps=1, save_steps=2, eval_strategy="steps",
                  eval_steps=2, per_device_eval_batch_size=8, metric_for_best_model="reward", use_cpu=True,
                  bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=3)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=correct, args=args, train_dataset=Dataset.from_list(rows(0, 32)),
                      eval_dataset={"easy": Dataset.from_list(rows(100, 8)), "hard": Dataset.from_list(rows(900, 4))},
                      callbacks=[recorder])
trainer.train()
metrics = trainer.evaluate()
state = trainer.state  # the best evaluation's step and checkpoint (their values differ: TRL samples, grpo is greedy)
write_report(trainer, recorder, evaluate=metrics,
             best_recorded=[state.best_metric is not None, state.best_global_step in (2, 4),
                            state.best_model_checkpoint in (f"{OUT}/checkpoint-2", f"{OUT}/checkpoint-4")])
