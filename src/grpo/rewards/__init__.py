"""Rewards for GRPO: a registry of TRL-signature reward functions and the scoring step.

A reward function is called as TRL 1.16 calls it, by keyword (``prompts``, ``completions``,
``completion_ids``, the dataset columns, ``trainer_state``, ``log_extra``, ``log_metric``) and returns
``list[float | None]`` (see ``signature.py``), so TRL reward functions run unchanged. Modules:

- ``answers``:  completion text, ``extract_answer``, ``is_well_formatted``, ``answers_equal``
- ``builtin``:  ``answer_correct``, ``format_think_answer`` and the Unsloth GSM8K five
- ``signature``: what a reward function is called with and returns
- ``reward_model``: a local sequence-classification reward model (``"model"``, params ``path``)
- ``remote``:   an HTTP reward endpoint (``"remote"``, params ``url``)
- ``registry``: names -> factories (and the gold each reads), and user functions by ``"package.module:function"``
- ``context``:  ``RewardContext``: ``trainer_state`` and the ``log_metric`` / ``log_extra`` hooks
- ``async_loop``: the event loop async rewards are awaited on
- ``reward_function``: ``RewardFunction``: the keyword call; a failing sample abstains, a reward failing on
                every sample is an error
- ``scoring``:  ``RewardSpec``, ``build_reward_functions``, ``score`` -> ``RewardScores``
"""

from grpo.rewards.answers import answers_equal, completion_text, extract_answer, is_well_formatted
from grpo.rewards.registry import (
    REWARD_REGISTRY,
    get_reward_function,
    list_rewards,
    load_dotted,
    register_reward,
    reward_gold,
)
from grpo.rewards.remote import RemoteRewardError
from grpo.rewards.reward_function import RewardFunction
from grpo.rewards.scoring import RewardScores, RewardSpec, build_reward_functions, score
from grpo.rewards.signature import RewardCallable, RewardError, RewardFactory

__all__ = [
    "REWARD_REGISTRY",
    "RemoteRewardError",
    "RewardCallable",
    "RewardError",
    "RewardFactory",
    "RewardFunction",
    "RewardScores",
    "RewardSpec",
    "answers_equal",
    "build_reward_functions",
    "completion_text",
    "extract_answer",
    "get_reward_function",
    "is_well_formatted",
    "list_rewards",
    "load_dotted",
    "register_reward",
    "reward_gold",
    "score",
]
