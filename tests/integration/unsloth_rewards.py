"""The Unsloth / willccbb GSM8K GRPO reward functions, written the way users copy them into their
scripts (keyword-style TRL signatures, ``completion[0]['content']``, ``**kwargs``): grpo must run them
unchanged, by dotted path (``unsloth_rewards:correctness_reward_func``). They are the ones of
examples/grpo_gsm8k_unsloth.py (the Python API's example), loaded from that file so there is one copy;
below them, rewards that use the rest of TRL's call."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "grpo_gsm8k_unsloth", Path(__file__).resolve().parents[2] / "examples" / "grpo_gsm8k_unsloth.py")
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

extract_xml_answer = _example.extract_xml_answer
correctness_reward_func = _example.correctness_reward_func
int_reward_func = _example.int_reward_func
strict_format_reward_func = _example.strict_format_reward_func
soft_format_reward_func = _example.soft_format_reward_func
count_xml = _example.count_xml
xmlcount_reward_func = _example.xmlcount_reward_func


# --- rewards that use the rest of TRL's call: completion_ids, trainer_state, log_metric, log_extra ---


def length_curriculum(completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs) -> list[float]:
    """A curriculum-style reward: the length penalty grows with training progress; logs what it saw."""
    progress = trainer_state.global_step / trainer_state.max_steps
    log_metric("curriculum/progress", progress)
    log_extra("num_tokens", [len(ids) for ids in completion_ids])
    return [-progress * len(ids) / 100 for ids in completion_ids]


async def async_length(completions, completion_ids, **kwargs) -> list[float]:
    """An async reward (an LLM judge would await its client here)."""
    return [len(ids) / 100 for ids in completion_ids]


def make_keyword_bonus(keyword: str, bonus: float):
    """A user reward factory (as TRL's get_soft_overlong_punishment): built once with its arguments."""
    def keyword_bonus(completions, **kwargs) -> list[float]:
        return [bonus if keyword in c[0]["content"] else 0.0 for c in completions]

    return keyword_bonus
