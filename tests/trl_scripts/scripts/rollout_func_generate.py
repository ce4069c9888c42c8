"""A custom rollout_func(prompts, trainer) as TRL 1.16 calls it: it renders and samples with trainer.model,
trainer.processing_class and trainer.args, and returns ids, sampling log-probs and an extra reward column."""

import sys

import torch
from datasets import Dataset
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(2, 18)])
calls = []


def rollout_func(prompts, trainer):
    tokenizer, args = trainer.processing_class, trainer.args
    prompt_ids, completion_ids, logprobs = [], [], []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)
        with torch.no_grad():
            out = trainer.model.generate(torch.tensor([ids]), do_sample=True, temperature=args.temperature,
                                         max_new_tokens=args.max_completion_length, output_scores=True,
                                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        new = out.sequences[0, len(ids):].tolist()
        steps = [torch.log_softmax(s[0].float() / args.temperature, -1) for s in out.scores]
        prompt_ids.append(ids)
        completion_ids.append(new)
        logprobs.append([step[token].item() for step, token in zip(steps, new)])
    calls.append(len(prompts))
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
            "length_bonus": [len(c) / 100 for c in completion_ids]}


def uses_bonus(completions, length_bonus, **kwargs):
    return [float(b) for b in length_bonus]


args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=2, learning_rate=1e-5, logging_steps=1, save_steps=2, use_cpu=True, bf16=False,
                  gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=7)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=uses_bonus, args=args, train_dataset=dataset,
                      rollout_func=rollout_func, callbacks=[recorder])
trainer.train()
write_report(trainer, recorder, rollout_calls=calls)
