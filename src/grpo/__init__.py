"""grpo: Group Relative Policy Optimization for causal language models.

``from grpo import GRPOConfig, GRPOTrainer``: the Python API (``grpo.api``), loaded on first use so that
importing one submodule (``grpo.errors``, ``grpo.data``...) does not load the whole API with it."""

import importlib

from grpo.version import __version__

__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name in __all__:  # PEP 562: the API (torch, transformers) loads on first use, not with every submodule
        return getattr(importlib.import_module("grpo.api"), name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
