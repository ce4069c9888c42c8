"""The Python API: ``GRPOConfig`` and ``GRPOTrainer``, drop-ins for TRL 1.16's classes of the same names
(``from trl import ...`` -> ``from grpo import ...``), on the same training path as ``grpo train``.

- ``arguments``: ``GRPOConfig``, TRL's argument names and defaults; what grpo does not implement is refused
- ``mapping``:   the one mapping from those arguments to grpo's config tree, and back (recipes)
- ``datasets``:  TRL's datasets (a ``prompt`` column, text or chat) as ``Example`` records
- ``rewards``:   ``reward_funcs`` (callables, model ids, models) as ``RewardFunction``s, named as TRL names them
- ``callbacks``: ``TrainerState.log_history`` with TRL's metric names, ``TrainerCallback`` events
- ``prompts``:   prompt lengths as the rollout renders them, refused in a TRL user's words
- ``checkpoints``: ``train(resume_from_checkpoint=...)`` by TRL's rules over ``checkpoint-<step>/`` folders
- ``trainer``:   ``GRPOTrainer``: train, evaluate, save_model, plot
- ``attributes``: TRL's trainer attributes a ``rollout_func(prompts, trainer)`` reads
"""

from grpo.api.arguments import GRPOConfig
from grpo.api.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
