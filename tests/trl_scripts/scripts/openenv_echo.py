"""TRL's OpenEnv guide, "Quick start": an echo environment client wrapped as an environment_factory class whose
tool steps the OpenEnv server and whose last reward is the rollout's reward. As in the guide but for the tiny model
and a short run; the server (the package `openenv init echo_env` writes) runs locally at ECHO_ENV_URL."""

import os
import sys

from datasets import Dataset
from echo_env import EchoEnv
from echo_env.models import EchoAction
from transformers import AutoTokenizer
from report_callback import EventRecorder, write_report

from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template

MODEL, OUT = sys.argv[1], sys.argv[2]
ENV_URL = os.environ["ECHO_ENV_URL"]
tokenizer = AutoTokenizer.from_pretrained(MODEL)
tokenizer.response_template = qwen3_template  # the tiny model's tool calls are Qwen's <tool_call> JSON
created, echoed = [], []


class EchoToolEnv:
    def __init__(self):
        self.env = EchoEnv(base_url=ENV_URL)
        self.reward = 0.0
        created.append(self)

    def reset(self, **kwargs) -> str | None:
        self.reward = 0.0
        return None

    def echo(self, message: str) -> str:
        """
        Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        observation = self.env.step(EchoAction(message=message))
        self.reward = observation.observation.reward
        echoed.append(observation.observation.echoed_message)
        return observation.observation.echoed_message


def reward_func(environments, **kwargs):
    return [env.reward for env in environments]


dataset = Dataset.from_dict(
    {"prompt": [[{"role": "user", "content": "Try to echo 'Hello World!' in the environment."}]] * 16}
)

recorder = EventRecorder()
trainer = GRPOTrainer(
    model=MODEL,
    train_dataset=dataset,
    reward_funcs=reward_func,
    args=GRPOConfig(
        chat_template_kwargs={"enable_thinking": False},
        log_completions=True,
        output_dir=OUT, per_device_train_batch_size=8, num_generations=4, max_completion_length=64, max_steps=2,
        learning_rate=1e-5, logging_steps=1, save_steps=2, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", disable_tqdm=True, seed=6, max_tool_calling_iterations=1,
    ),
    processing_class=tokenizer,
    environment_factory=EchoToolEnv,
    callbacks=[recorder],
)
trainer.train()
write_report(trainer, recorder, environments_created=len(created), echo_calls=len(echoed),
             echoed_all_came_back=all(isinstance(text, str) for text in echoed))
