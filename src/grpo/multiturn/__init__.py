"""Multi-turn rollouts: tools, environments and a user rollout hook."""
