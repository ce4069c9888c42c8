"""A tool-calling script as TRL 1.16's documentation writes one: chat prompts, ``tools=[calculator]`` (the model
writes ``<tool_call>`` blocks, the trainer runs the function and appends its result), a reward on the final
answer, a LoRA adapter and ``num_iterations=2`` (two optimizer updates per generation). Only the import line
differs between TRL and grpo:

    python benchmarks/scripts/tools_lora.py              # grpo
    python benchmarks/scripts/tools_lora.py --trl        # TRL

The model is grpo's shipped tool-calling model (assets/tiny-tools), the problems and the calculator are grpo's
(no download); timed by benchmarks/api_vs_trl.py.
"""

import argparse
import re

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer

# How a reply of this model is parsed into content and tool calls (transformers' response parsing, which TRL
# asks for when it does not know the chat template): TRL's Qwen3 template, the hermes <tool_call> blocks.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


SYSTEM_PROMPT = ("Respond in the following format:\n<think>\n...\n</think>\n<answer>\n...\n</answer>\n"
                 "Think step by step inside <think> tags, then give only the final number inside <answer> tags.")


def make_dataset(rows: int) -> Dataset:
    from grpo.data.arithmetic_tools import generate_tool_problems  # one-step problems with large numbers

    return Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": e.messages[-1]["content"]}],
                               "answer": e.answer}
                              for e in generate_tool_problems(rows, seed=7, size="mix")])


def correctness(completions, answer, **kwargs):
    """1 when the last number of the final assistant message is the answer."""
    rewards = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion[-1]["content"])
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl", action="store_true", help="run TRL's GRPOTrainer instead of grpo's")
    parser.add_argument("--model", default="assets/tiny-tools")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="outputs/tools-lora")
    args = parser.parse_args()

    if args.trl:
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo import GRPOConfig, GRPOTrainer  # the one line that changes
    from grpo.multiturn.calculator import calculator  # a plain function with a docstring, as TRL wants tools

    training_args = GRPOConfig(
        output_dir=args.output_dir,
        learning_rate=1e-5,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=96,
        num_iterations=2,
        max_tool_calling_iterations=1,
        max_steps=args.max_steps,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.response_template = RESPONSE_TEMPLATE
    trainer = GRPOTrainer(
        model=args.model,
        processing_class=tokenizer,
        reward_funcs=correctness,
        args=training_args,
        train_dataset=make_dataset(256),
        tools=[calculator],
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    for entry in trainer.state.log_history:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})


if __name__ == "__main__":
    main()
