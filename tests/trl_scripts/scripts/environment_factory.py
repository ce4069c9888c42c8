"""An environment class (TRL's environment_factory): reset() per rollout, its methods as tools, get_reward()."""

import sys

from datasets import Dataset
from transformers import AutoTokenizer
from report_callback import EventRecorder, write_report

from grpo.data.arithmetic_tools import generate_tool_problems
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template

MODEL, OUT = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(MODEL)
tokenizer.response_template = qwen3_template  # the model's tool calls are Qwen's <tool_call> JSON
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": e.question}], "answer": e.answer}
                             for e in generate_tool_problems(16, seed=6, size="large")])
created = []


class CalculatorEnv:
    def __init__(self):
        created.append(self)

    def reset(self, answer, **row):
        self.answer, self.results = answer, []
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression to evaluate.
        """
        if not set(expression) <= set("0123456789+-*/(). "):
            raise ValueError("unsupported characters")
        result = str(eval(expression))  # noqa: S307 (checked characters)
        self.results.append(result)
        return result

    def get_reward(self):
        return 1.0 if self.answer in self.results else 0.0


def answered(completions, answer, **kwargs):
    return [1.0 if a in (c[-1]["content"] or "") else 0.0 for c, a in zip(completions, answer)]


args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
                  max_steps=2, learning_rate=1e-5, logging_steps=1, save_steps=2, use_cpu=True, bf16=False,
                  gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=6,
                  max_tool_calling_iterations=1)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=answered, args=args, train_dataset=dataset,
                      processing_class=tokenizer,
                      environment_factory=CalculatorEnv, callbacks=[recorder])
trainer.train()
write_report(trainer, recorder, environments_created=len(created))
