"""The attributes of TRL's ``GRPOTrainer`` that code given to it reads: a ``rollout_func`` is called as
``rollout_func(prompts, trainer)`` (TRL 1.16: ``self.rollout_func(prompts, self)``) and reads ``trainer.model``,
``trainer.args``, ``trainer.processing_class``, ... An attribute grpo's trainer lacks is an AttributeError that
says what it has, not a bare one from inside the user's function."""

from __future__ import annotations


class TrainerAttributes:
    """Mixed into ``GRPOTrainer`` (which sets ``args``, ``rollout_func`` and ``rollout_context``)."""

    @property
    def num_generations(self) -> int:
        return self.args.num_generations

    @property
    def max_completion_length(self) -> int:
        return self.args.max_completion_length

    @property
    def temperature(self) -> float:
        return self.args.temperature

    @property
    def use_vllm(self) -> bool:
        return self.args.use_vllm

    def _rollout_func(self):
        """The user's ``rollout_func`` called as TRL calls it, with this trainer (``model`` holds the current
        weights); grpo's ``RolloutHookContext`` (sampling settings, seed, the run's engine) is
        ``trainer.rollout_context`` meanwhile."""
        fn = self.rollout_func
        if fn is None:
            return None

        def with_trainer(prompts, context):
            self.rollout_context = context
            try:
                return fn(prompts, self)
            finally:
                self.rollout_context = None

        with_trainer.__name__ = getattr(fn, "__name__", type(fn).__name__)  # errors name the user's function
        return with_trainer

    def __getattr__(self, name: str):
        """Only for names not found: TRL's trainer has more than grpo's, so say what there is."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"grpo's GRPOTrainer has no attribute {name!r} (TRL's has more): it offers model, args, "
            "processing_class, state, num_generations, max_completion_length, temperature, use_vllm, "
            "reward_func_names, train_dataset, eval_dataset and, inside a rollout_func, rollout_context (grpo's "
            "sampling settings, seed and engine: rollout_context.engine.generate_ids samples with the current "
            "weights)")
