"""TRL's batch arithmetic in grpo's terms: one TRL generation is one grpo step (``generation_shape``: its prompts and
its mini-batches, one optimizer update each), and TRL's counts of optimizer updates become grpo steps (``grpo_steps``,
``per_step_interval``; ``Counts`` carries what converts them, both ways). ``args`` is a ``grpo.api.GRPOConfig``,
read by its fields' names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def generation_shape(B: int, GA: int, G: int, steps_per_generation: int | None, generation_batch_size: int | None,
                     processes: int) -> tuple[int, int]:
    """(prompts per step over all ranks, mini-batches per step) of TRL's batch arguments. TRL's generation is
    ``B x processes x steps_per_generation`` completions (``steps_per_generation`` given, else
    ``generation_batch_size / (B x processes)``, else GA: ``GRPOConfig.__post_init__``), G per prompt, and an
    optimizer update takes GA micro-batches of B: ``steps_per_generation / GA`` updates per pass over it, grpo's
    ``train.mini_batches``. A ValueError for a shape TRL refuses (in TRL's words) or grpo cannot run."""
    if generation_batch_size is not None:
        if generation_batch_size % (B * processes):
            raise ValueError(f"GRPOConfig: generation_batch_size ({generation_batch_size}) must be divisible by the "
                             f"global batch size ({B * processes}).")
        steps_per_generation = generation_batch_size // (B * processes)
    spg = steps_per_generation or GA
    completions = B * processes * spg
    if completions % G:
        raise ValueError(f"GRPOConfig: the generation batch ({B} x {processes} processes x {spg} steps per generation "
                         f"= {completions} completions) is not divisible by num_generations {G}")
    if spg % GA:
        raise ValueError(f"GRPOConfig.steps_per_generation={spg} is not supported with "
                         f"gradient_accumulation_steps={GA}: a grpo optimizer update takes a whole share of one "
                         "generation, so steps_per_generation must be a multiple of gradient_accumulation_steps (TRL "
                         "would accumulate an update across two generations)")
    mini_batches = spg // GA
    if mini_batches > 1 and (B * GA) % G:
        raise ValueError(f"GRPOConfig.steps_per_generation={spg} is not supported with per_device_train_batch_size={B} "
                         f"x gradient_accumulation_steps={GA} = {B * GA} completions per update and process, not whole "
                         f"groups of num_generations {G}: grpo keeps a prompt's completions in one update (TRL "
                         "shuffles the generation's rows and splits groups between updates at random); make B x GA "
                         "a multiple of num_generations")
    return completions // G, mini_batches


def batch_shape(args: Any, num_processes: int) -> tuple[int, int, int]:
    """(prompts per step over all ranks, completions per micro-batch, mini-batches per step) of ``args``
    (``generation_shape``'s arithmetic)."""
    prompts, mini_batches = generation_shape(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                             args.num_generations, args.steps_per_generation,
                                             args.generation_batch_size, num_processes)
    return prompts, args.per_device_train_batch_size, mini_batches


def grpo_steps(args: Any, prompts_per_step: int, train_size: int | None, mini_batches: int = 1) -> int:
    """grpo's ``train.max_steps``: TRL's ``max_steps`` / the updates per generation (num_iterations x
    ``mini_batches``), or from ``num_train_epochs`` as TRL counts them (each epoch drops the prompts that do not
    fill a last generation; its updates: generations x num_iterations x steps_per_generation / GA)."""
    ni = args.num_iterations
    per_step = ni * mini_batches
    if args.max_steps > 0:
        if args.max_steps % per_step:
            what = (f"num_iterations {ni}" if mini_batches == 1 else
                    f"the updates per generation {per_step} (num_iterations {ni} x steps_per_generation / "
                    f"gradient_accumulation_steps {mini_batches})")
            raise ValueError(f"GRPOConfig.max_steps={args.max_steps} is not a multiple of {what}: a grpo step is one "
                             "rollout and its updates")
        return args.max_steps // per_step
    if train_size is None:
        raise ValueError("GRPOConfig.max_steps=-1 counts steps from num_train_epochs and the train dataset's "
                         "length: pass train_size (GRPOTrainer does) or set max_steps")
    per_epoch = train_size // prompts_per_step
    if per_epoch == 0:
        raise ValueError(f"the train dataset has {train_size} prompts, fewer than one step's {prompts_per_step}")
    return max(1, math.ceil(math.ceil(args.num_train_epochs * per_epoch * per_step) / per_step))


def per_step_interval(value: float, per_step: int, max_updates: int) -> int:
    """A TRL interval in updates (a float below 1: a share of max_steps) as grpo steps, rounded up."""
    updates = math.ceil(value * max_updates) if value < 1 else int(value)
    return max(1, math.ceil(updates / per_step))


@dataclass(frozen=True)
class Counts:
    """What converts TRL's counts to grpo's and back: ``processes`` (ranks; 1 reading a recipe back),
    ``per_step`` (updates per grpo step: num_iterations x mini-batches), ``steps`` (grpo steps) and ``updates``
    (steps x per_step)."""

    processes: int
    per_step: int
    steps: int
    updates: int
