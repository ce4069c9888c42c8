"""grpo: Group Relative Policy Optimization for causal language models."""
__version__ = "0.1.0"
