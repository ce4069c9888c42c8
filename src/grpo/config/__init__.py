"""One typed config tree (``grpo.config.schema``), loaded from YAML with ``key=value`` overrides."""

from grpo.config.loader import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    dump_config,
    iter_config_keys,
    load_config,
    parse_override,
)
from grpo.config.schema import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DecoupledConfig,
    EvalConfig,
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
    "ConfigError", "config_from_dict", "config_to_dict", "dump_config", "iter_config_keys", "load_config", "parse_override",
    "AlgorithmConfig", "CriticConfig", "DataConfig", "DecoupledConfig", "EvalConfig", "LogConfig", "LossConfig", "ModelConfig",
    "OptimConfig", "PtxConfig", "RewardConfig", "RolloutConfig", "RunConfig", "TrainConfig",
]
