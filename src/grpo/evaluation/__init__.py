"""Evaluating a policy on examples: generate (greedy and sampled), score with the task and rewards
(``example_records``), and the sampled-evaluation statistics (``sample_metrics``: pass@k, majority vote, intervals).
Used by ``grpo eval`` (``grpo.commands.eval_command``) and by evaluation during training (``grpo.training.evaluator``)."""
