"""Multi-turn rollouts: tools, environments and a user rollout hook (issue 27)."""
