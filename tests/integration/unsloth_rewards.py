"""The Unsloth / willccbb GSM8K GRPO reward functions, written the way users copy them into their
scripts (keyword-style TRL signatures, ``completion[0]['content']``, ``**kwargs``): grpo must run them
unchanged, by dotted path. Only the print in ``correctness_reward_func`` is left out."""

import re


def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    q = prompts[0][-1]["content"]  # noqa: F841  (the original prints it)
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
