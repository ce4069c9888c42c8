"""Evaluation inside a run: held-out greedy accuracy on rank 0 at start, every ``train.eval_steps`` and at
the end, and the metrics it logs."""

from __future__ import annotations

from grpo.config import RunConfig
from grpo.tasks import run_system_prompt
from grpo.models.wrappers import unwrap_model
from grpo.training.distributed import DistInfo, barrier


def run_eval(cfg: RunConfig, model, tokenizer, examples, info: DistInfo, turns=None) -> dict | None:
    """Greedy held-out accuracy on rank 0 (others wait); None without a held-out set. With the run's tools or
    environment (``turns``, a ``grpo.multiturn.setup.TurnSpec``) the model answers with them, as it trains.

    Without rollout.repetition_penalty / min_new_tokens / min_p: they shape exploration during training,
    while the held-out accuracy measures the policy itself, greedily, comparable across runs that
    sample differently (and with the before-training figure)."""
    if not examples:
        return None
    from grpo.tools.evaluate import evaluate

    result = None
    if info.is_main:
        batch_size = max(cfg.train.micro_batch_size, 16)
        engine = None
        if turns is not None and turns.active and turns.rollout_func is None:  # a hook's rollouts are the user's
            from grpo.multiturn.setup import with_turns
            from grpo.rollout import LeanEngine

            engine = with_turns(LeanEngine(unwrap_model(model), tokenizer, batch_size=batch_size), turns, cfg,
                                model, tokenizer)
        result = evaluate(unwrap_model(model), tokenizer, examples, tag_style=cfg.data.tag_style,
                          system_prompt=run_system_prompt(cfg),
                          add_system_prompt=cfg.data.add_system_prompt, batch_size=batch_size,
                          max_new_tokens=cfg.rollout.max_completion_length, progress=False, engine=engine,
                          max_prompt_length=cfg.data.max_prompt_length)
    barrier(info)
    return result


def eval_metrics(result: dict | None) -> dict[str, float]:
    """``eval/accuracy`` and ``eval/format_rate`` of an evaluation result (empty for None)."""
    if not result:
        return {}
    tools = {f"eval/{k}": v for k, v in result.items() if k.startswith("tools/")}  # answered with tools
    return {"eval/accuracy": result["accuracy"], "eval/format_rate": result["format_rate"], **tools}
