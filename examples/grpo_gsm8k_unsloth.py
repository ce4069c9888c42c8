"""The Unsloth / willccbb GSM8K GRPO recipe, written as a TRL 1.16 user writes it. Only the import line
differs between TRL and grpo; run it either way on the shipped tiny model, on a CPU:

    python examples/grpo_gsm8k_unsloth.py                  # grpo  (from grpo import GRPOConfig, GRPOTrainer)
    python examples/grpo_gsm8k_unsloth.py --trl            # TRL   (from trl import GRPOConfig, GRPOTrainer)
    python examples/grpo_gsm8k_unsloth.py --gsm8k ../shared/data/gsm8k/train.jsonl --model Qwen/Qwen2.5-0.5B-Instruct

Without --gsm8k the questions are grpo's synthetic GSM8K-style word problems (no download needed).
"""

import argparse
import re

from datasets import Dataset, load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""


def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def extract_hash_answer(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.split("####")[1].strip()


def get_gsm8k_questions(path: str | None, rows: int) -> Dataset:
    if path:
        data = load_dataset("json", data_files=path, split="train")
    else:  # grpo's synthetic word problems, written as GSM8K rows
        from grpo.data.synthetic import generate_problems

        data = Dataset.from_list([{"question": e.question, "answer": f"{e.answer_raw}\n#### {e.answer}"}
                                  for e in generate_problems(rows, seed=7, difficulty="demo")])
    data = data.map(lambda x: {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": x["question"]},
        ],
        "answer": extract_hash_answer(x["answer"]),
    })
    return data


# Reward functions
def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    extracted_responses = [extract_xml_answer(r) for r in responses]
    return [2.0 if r == a else 0.0 for r, a in zip(extracted_responses, answer)]


def int_reward_func(completions, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    extracted_responses = [extract_xml_answer(r) for r in responses]
    return [0.5 if r.isdigit() else 0.0 for r in extracted_responses]


def strict_format_reward_func(completions, **kwargs) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
    responses = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, r) for r in responses]
    return [0.5 if match else 0.0 for match in matches]


def soft_format_reward_func(completions, **kwargs) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
    responses = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, r) for r in responses]
    return [0.5 if match else 0.0 for match in matches]


def count_xml(text) -> float:
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def xmlcount_reward_func(completions, **kwargs) -> list[float]:
    contents = [completion[0]["content"] for completion in completions]
    return [count_xml(c) for c in contents]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl", action="store_true", help="run TRL's GRPOTrainer instead of grpo's")
    parser.add_argument("--model", default="assets/tiny-math")
    parser.add_argument("--gsm8k", help="a GSM8K .jsonl (default: synthetic GSM8K-style problems)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="outputs/grpo-gsm8k")
    args = parser.parse_args()

    if args.trl:
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo import GRPOConfig, GRPOTrainer  # the one line that changes

    dataset = get_gsm8k_questions(args.gsm8k, rows=512)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    peft_config = LoraConfig(r=16, lora_alpha=64, lora_dropout=0.05, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                                             "gate_proj"])
    training_args = GRPOConfig(
        output_dir=args.output_dir,
        learning_rate=5e-6,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        warmup_steps=0.1,
        lr_scheduler_type="cosine",
        optim="adamw_torch",
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_generations=8,
        max_completion_length=64,
        max_steps=args.max_steps,
        save_steps=args.max_steps,
        max_grad_norm=0.1,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[xmlcount_reward_func, soft_format_reward_func, strict_format_reward_func, int_reward_func,
                      correctness_reward_func],
        args=training_args,
        train_dataset=dataset,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(f"{args.output_dir}/final")
    for entry in trainer.state.log_history:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})


if __name__ == "__main__":
    main()
