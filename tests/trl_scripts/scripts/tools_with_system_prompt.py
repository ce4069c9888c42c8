"""A calculator tool, a system message in every prompt (TRL's tools guide), on the tool-calling tiny model."""

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
SYSTEM = "You are a careful assistant. Use the calculator for large numbers, then give the answer."
dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": e.question}], "answer": e.answer}
                             for e in generate_tool_problems(16, seed=5, size="large")])


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, e.g. "12 * 34".
    """
    if not set(expression) <= set("0123456789+-*/(). "):
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression))  # noqa: S307 (checked characters)


def correct(completions, answer, **kwargs):
    return [1.0 if f"<answer>\n{a}\n</answer>" in (c[-1]["content"] or "") else 0.0
            for c, a in zip(completions, answer)]


args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
                  max_steps=2, learning_rate=1e-5, logging_steps=1, save_steps=2, use_cpu=True, bf16=False,
                  gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=5,
                  max_tool_calling_iterations=1, log_completions=True)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=correct, args=args, train_dataset=dataset,
                      processing_class=tokenizer, tools=[calculator],
                      callbacks=[recorder])
trainer.train()
write_report(trainer, recorder)
