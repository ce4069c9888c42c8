"""grpo: Group Relative Policy Optimization for causal language models.

``from grpo import GRPOConfig, GRPOTrainer``: the Python API (``grpo.api``), loaded on first use so that
``import grpo`` (and the ``grpo`` command) stays light."""

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name in __all__:
        import grpo.api

        return getattr(grpo.api, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
