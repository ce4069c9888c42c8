"""What a rollout engine returns for a batch of prompts. Shapes and units here; no logic.

Rows are completions; the ``G`` completions of one prompt are contiguous (rows ``i*G .. i*G+G-1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class Generation:
    """What a rollout engine returns for a batch of prompts, ``N = P * G`` rows.

    prompt_ids:      [N, Lp] long, left-padded with the pad id.
    prompt_mask:     [N, Lp] long, 1 for real prompt tokens.
    completion_ids:  [N, Lc] long, right-padded with the pad id (Lc <= max_completion_length).
    completion_mask: [N, Lc] long, 1 for tokens up to and including the first EOS, 0 after it.
    truncated:       [N] bool, True when no EOS was produced within max_completion_length.
    completions:     N decoded completion texts (special tokens removed).
    sampler_logprobs: [N, Lc] float32 the engine's own log-prob of each sampled token (0 on padding), from
                     an engine whose weights are not the trainer's (vLLM); None when it samples from the
                     policy itself. ``sample_and_score`` carries it into ``RolloutBatch.sampler_logprobs``.
                     In a multi-turn row it is 0 on the environment's tokens (nothing sampled them).
    loss_mask:       [N, Lc] long, 1 on the tokens the model sampled (the actions), 0 on tokens the environment
                     inserted (tool results, an environment's turns) and on padding; always <= completion_mask.
                     None for single-turn rows: every real completion token was sampled (``sampled_mask``).
                     Environment tokens stay in completion_ids and completion_mask: they are context that
                     every log-prob pass sees, never a term of the loss, the KL, the entropy or a length.
    token_versions:  [N, Lc] long, the policy version of the weights that sampled each token (decoupled mode;
                     read under ``sampled_mask``, 0 elsewhere): one version for a whole generation, or several when
                     the weights changed mid-sequence (``decoupled.weight_update: in_flight``). None when the
                     engine does not track versions (colocated: the trainer's own weights sampled).
    messages:        N completions as chat messages (assistant turns with their ``tool_calls``, ``tool``
                     messages), as TRL passes multi-turn completions to rewards; None for single-turn rows.
    rollout_metrics: name -> mean over the rows, from the multi-turn driver (``tools/calls_per_completion``...).
    routing:         [N, Lp + Lc, layers, k] int16, the experts each router of an MoE policy chose for each token
                     while sampling, over the columns of prompt_ids then completion_ids (-1: not recorded, the
                     pass routes it itself: padding, each row's last sampled token, which was never fed back); for
                     ``loss.routing_replay`` (``grpo.models.routing_replay``). None when not recorded.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    completions: list[str]
    sampler_logprobs: Tensor | None = None
    loss_mask: Tensor | None = None
    token_versions: Tensor | None = None
    messages: list[list[dict]] | None = None
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    routing: Tensor | None = None

    @property
    def sampled_mask(self) -> Tensor:
        """[N, Lc] long: 1 on the tokens that carry the loss (``loss_mask``, or ``completion_mask`` when single-turn)."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask
