"""User reward functions loaded by dotted path in the integration tests (as a user's would be)."""

import json
import os


def letters(prompts, completions, **kwargs):
    """Share of lower-case ASCII letters in the completion: it varies within every group of a random
    tiny model's samples (so there is signal) and the model can learn to raise it, which makes
    'the reward rises' checkable in a few CPU steps."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum("a" <= ch <= "z" for ch in t) / max(len(t), 1) for t in texts]


def record_prompts(prompts, completions, log_metric, **kwargs):
    """Reward 0; appends (rank, question) per completion to $GRPO_TEST_PROMPT_LOG.<rank>. Logs the rank
    (averaged over ranks in metrics.jsonl) and, on rank 1 only, a metric the other rank never logs."""
    rank = os.environ.get("RANK", "0")
    log_metric("test/rank", float(rank))
    if rank == "1":
        log_metric("test/rank1_only", 3.0)
    with open(f"{os.environ['GRPO_TEST_PROMPT_LOG']}.{rank}", "a") as f:
        for question in kwargs["question"]:
            f.write(json.dumps({"rank": int(rank), "question": question}) + "\n")
    return [0.0] * len(completions)


def letters_on_even_answers(prompts, completions, answer, **kwargs):
    """``letters`` for prompts whose gold answer is even, 0 for the others: on a random tiny model about
    half the groups then have rewards that are all equal (0), the rest differ. For dynamic sampling."""
    return [score if int(gold) % 2 == 0 else 0.0 for score, gold in zip(letters(prompts, completions), answer)]


def zero(prompts, completions, **kwargs):
    """Reward 0 for everything: every advantage is 0, so with loss.beta 0 the policy loss has no gradient
    and only an auxiliary loss (PTX) can move the weights."""
    return [0.0] * len(completions)


def characters_reward(prompts, completions, **kwargs):
    """The completion's length in characters."""
    from grpo.rewards.answers import completion_text

    return [float(len(completion_text(c))) for c in completions]
