"""The ``rollout`` section of the config tree (``grpo.config.schema``): how completions are sampled."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.fields import opt
from grpo.config.kinds import AUTO, ENGINE_TRAITS, TOOL_CALL_MARKERS


@dataclass
class RolloutConfig:
    engine: str = opt("auto", "Generation engine: auto (hf-static on CUDA, hf elsewhere; hf for a 4-bit base or "
                      "sliding-window layers), hf (lean KV-cache sampling loop over the HF model), "
                      "hf-static (for CUDA: static KV cache, decode step replayed as a CUDA graph, bf16 sampling copy "
                      "with LoRA merged), hf-generate (model.generate; same distribution, slower) or vllm (the "
                      "optional vllm extra; weights pushed in place after every update).",
                      choices=(AUTO, *ENGINE_TRAITS))
    num_generations: int = opt(8, "G: completions sampled per prompt (the group); 1 only with "
                               "algorithm.advantage_estimator gae (a group of one has no baseline).", ge=1)
    max_completion_length: int = opt(256, "Maximum new tokens per completion.", ge=1)
    temperature: float = opt(1.0, "Sampling temperature; log-probs are computed at the same temperature.", gt=0)
    top_p: float = opt(1.0, "Nucleus sampling threshold.", gt=0, le=1)
    top_k: int | None = opt(None, "Top-k sampling; null or 0 = off.", ge=0)
    repetition_penalty: float = opt(
        1.0, "HF's repetition penalty before temperature: the logit x of a token already in the prompt (left "
        "padding excluded) or the completion becomes x / p (x >= 0) or x * p (x < 0); 1 = off. The log-probs "
        "(old, new, reference) apply it too, so they are of the distribution sampled.", gt=0)
    min_new_tokens: int = opt(
        0, "Every EOS id is forbidden until this many tokens were generated (HF's min_new_tokens, vLLM's "
        "min_tokens); the log-probs forbid it too. 0 = off.", ge=0)
    min_p: float = opt(
        0.0, "Min-p sampling after temperature/top-k/top-p: drop tokens below min_p x the top token's probability; "
        "0 = off. Log-probs renormalise over the kept tokens (plus the sampled one, so they stay finite once the "
        "policy moves). Unlike top_k/top_p, whose log-probs are of the untruncated distribution (as TRL's): a "
        "top-p set needs a full-vocabulary sort per token in the training pass, min-p only a max. vLLM applies "
        "min_p before top_p (HF after): combine them only with hf engines for HF's semantics.", ge=0, le=1)
    vllm_gpu_memory_utilization: float = opt(
        0.3, "engine vllm: share of the GPU vLLM takes for weights + KV cache (colocated: leave room to train).",
        gt=0, le=1)
    vllm_enable_sleep_mode: bool = opt(
        False, "engine vllm: free vLLM's GPU memory during each update (sleep/wake; vLLM supports it on CUDA).")
    vllm_dtype: str = opt("auto", "engine vllm: vLLM's dtype (auto, bfloat16, float16, float32). auto is vLLM's "
                                  "choice, which samples a float32 checkpoint in bfloat16.",
                          choices=("auto", "bfloat16", "float16", "float32"))
    vllm_check_steps: int = opt(
        10, "engine vllm: compare vLLM's log-probs of its sampled tokens with the trainer's on a run's (or a "
            "resumed run's) first two steps and every N-th (every step when a step has more than one "
            "update, loss.num_iterations x train.mini_batches, where it is free), logged as rollout/logprob_diff; "
            "a gap above vllm_max_logprob_diff stops the run. Costs one no-grad forward pass per checked step. "
            "0 = never (an off-policy run would then go unnoticed).", ge=0)
    vllm_max_logprob_diff: float = opt(
        0.1, "engine vllm: largest mean |vLLM - trainer| log-prob of the sampled tokens a checked step accepts "
             "(measured here in fp32: 2e-7 with synced weights, 0.17 one step stale at lr 1e-3, 0.3-0.43 with "
             "other weights; bf16 on a GPU not yet measured).", gt=0)
    generation_batch_size: int | None = opt(
        None, "Completions generated per generate() call; null = all of a step's at once.", ge=1)
    dynamic_sampling: bool = opt(
        False, "DAPO: drop the groups whose G rewards are all equal (zero advantage, no gradient) and sample "
               "rounds of further prompts until each rank's batch is full of groups that differ "
               "(grpo.step.dynamic_sampling; counts logged as rollout/dynamic_*). Costs extra sampling rounds as more "
               "prompts become solved.")
    dynamic_sampling_max_rounds: int = opt(
        4, "dynamic_sampling: sampling rounds per step and rank, the first included, each as many prompts as an "
           "ordinary step's (verl's max_num_gen_batches counts the same, with 0 = unlimited, refused here). At the "
           "cap a short batch is filled with zero-spread groups, counted in rollout/dynamic_groups_filled.", ge=1)
    tools: list[str] = opt(
        [], "Tools the model may call, as 'module:function' (TRL's convention: typed, with a Google-style docstring; "
            "the chat template renders their schemas). Non-empty: multi-turn rollouts (grpo.multiturn): after each "
            "turn the tool calls are run and their results appended as tool messages (no loss on them), then "
            "generation continues.")
    environment: str | None = opt(
        None, "An environment class or factory, 'module:Class' (TRL's environment_factory): one instance per "
              "rollout, reset(**row) before it, its public methods the tools, its get_reward() an extra reward.")
    max_tool_calling_iterations: int | None = opt(
        None, "Tool rounds after the first turn; null = until max_completion_length (tool tokens count toward it).",
        ge=0)
    tool_timeout_s: float = opt(30.0, "A tool call running longer is answered with a timeout error.", gt=0)
    tool_call_format: str = opt("auto", "How tool calls are read from a turn: auto (from the chat template) or "
                                        "hermes (<tool_call>{json}</tool_call>, Qwen2.5/Qwen3).",
                                choices=(AUTO, *TOOL_CALL_MARKERS))
    rollout_func: str | None = opt(
        None, "'module:function' that makes the rollouts instead of grpo's engines (TRL's rollout_func): called with "
              "the step's prompts (each repeated num_generations times) and a context, it returns prompt_ids, "
              "completion_ids, logprobs and optionally env_mask (1 on sampled tokens).")
