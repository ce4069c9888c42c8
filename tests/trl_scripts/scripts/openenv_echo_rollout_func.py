"""TRL's OpenEnv guide, "environment_factory vs rollout_func": the rollout_func form, which generates the
completions itself and steps the echo environment with each one's text, its reward an extra column
(``env_reward``) the reward function reads. TRL 1.16 has no ``generate_rollout_completions`` helper, so the
generation is written out as a TRL 1.16 user writes it (trainer.model, processing_class, args); the server (the
package `openenv init echo_env` writes) runs locally at ECHO_ENV_URL."""

import os
import sys

import torch
from datasets import Dataset
from echo_env import EchoEnv
from echo_env.models import EchoAction
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer

MODEL, OUT = sys.argv[1], sys.argv[2]
client = EchoEnv(base_url=os.environ["ECHO_ENV_URL"])
steps = []


def generate_rollout_completions(trainer, prompts):
    tokenizer, args = trainer.processing_class, trainer.args
    outputs = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)
        with torch.no_grad():
            out = trainer.model.generate(torch.tensor([ids]), do_sample=True, temperature=args.temperature,
                                         max_new_tokens=args.max_completion_length, output_scores=True,
                                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        new = out.sequences[0, len(ids):].tolist()
        scores = [torch.log_softmax(s[0].float() / args.temperature, -1) for s in out.scores]
        outputs.append({"prompt_ids": ids, "completion_ids": new,
                        "logprobs": [step[token].item() for step, token in zip(scores, new)]})
    return outputs


def rollout_func(prompts, trainer):
    tokenizer = trainer.processing_class
    outputs = generate_rollout_completions(trainer, prompts)
    env_rewards = []
    for out in outputs:
        text = tokenizer.decode(out["completion_ids"], skip_special_tokens=True)
        result = client.step(EchoAction(message=text))
        env_rewards.append(result.reward)
        steps.append(result.observation.echoed_message == text)
    return {
        "prompt_ids": [out["prompt_ids"] for out in outputs],
        "completion_ids": [out["completion_ids"] for out in outputs],
        "logprobs": [out["logprobs"] for out in outputs],
        "env_reward": env_rewards,
    }


# the echo server's reward is 0.1 per character up to 1: three tokens keep it below 1 and varied
def reward_from_env(completions, **kwargs):
    return [float(reward) for reward in kwargs["env_reward"]]


dataset = Dataset.from_dict(
    {"prompt": [[{"role": "user", "content": "Try to echo 'Hello World!' in the environment."}]] * 16}
)
args = GRPOConfig(output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=3,
                  max_steps=2, learning_rate=1e-5, logging_steps=1, save_steps=2, use_cpu=True, bf16=False,
                  gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=7)
recorder = EventRecorder()
trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_from_env, args=args, train_dataset=dataset,
                      rollout_func=rollout_func, callbacks=[recorder])
trainer.train()
write_report(trainer, recorder, env_steps=len(steps), echoed_as_sent=all(steps))
