"""One typed config tree (``grpo.config.schema``), loaded from YAML with ``key=value`` overrides
(``grpo.config.loader``) and resolved against its task (``grpo.config.resolve``)."""

from grpo.config.loader import ConfigError, config_to_dict, dump_config, iter_config_keys, parse_override
from grpo.config.resolve import (
    ResolvedRun,
    config_from_dict,
    load_config,
    resolve_run,
    run_config_text,
)
from grpo.config.schema import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DecoupledConfig,
    EvalConfig,
    FsdpConfig,
    LogConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PtxConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "ConfigError", "ResolvedRun", "config_from_dict", "config_to_dict", "dump_config", "iter_config_keys", "load_config",
    "parse_override", "resolve_run", "run_config_text",
    "AlgorithmConfig", "CriticConfig", "DataConfig", "DecoupledConfig", "EvalConfig", "FsdpConfig", "LogConfig", "LossConfig", "ModelConfig",
    "OptimConfig", "PtxConfig", "RewardConfig", "RolloutConfig", "RunConfig", "TrainConfig",
]
