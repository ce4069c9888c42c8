"""PPO's critic (``algorithm.advantage_estimator: gae``): a value model, the token-level advantages
it makes possible, its update and its part of a checkpoint.

- ``value_model``: ``ValueModel`` (causal LM body + scalar head), loading, values of a generation's tokens.
- ``critic_update``: ``build_critic`` (AdamW, schedule, DDP) and ``train_critic`` (clipped value loss).
- ``critic_checkpoint``: ``save_critic``/``load_critic`` into a run checkpoint's ``critic/`` folder.
The token-level advantages it makes possible are pure math: ``grpo.algorithm.ppo.ppo_advantages``.
"""

from grpo.algorithm.ppo import ppo_advantages
from grpo.critic.critic_checkpoint import CRITIC_DIR, load_critic, save_critic
from grpo.critic.critic_update import Critic, CriticSettings, build_critic, train_critic, value_fit
from grpo.critic.value_model import ValueModel, completion_values, generation_values, load_value_model

__all__ = ["CRITIC_DIR", "Critic", "CriticSettings", "ValueModel", "build_critic", "completion_values",
           "generation_values", "load_critic", "load_value_model", "ppo_advantages", "save_critic", "train_critic",
           "value_fit"]
