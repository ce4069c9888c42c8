"""The one typed config tree: every setting of a run, its default, its allowed values and why.

Leaf names follow TRL's ``GRPOConfig`` where the concept is the same. Each field carries a ``help`` string
(docs/reference/config.md's key table is generated from it) and, where it matters, ``choices`` or a range
(``ge``/``gt``/``le``). It only declares: the cross-field rules are ``grpo.config.rules``', reading YAML and
overrides is ``grpo.config.loader``'s, and what fills a run's unset values from its task is ``grpo.config.resolve``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo.algorithm import ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS
from grpo.algorithm.schedules import LR_SCHEDULES
from grpo.config.decoupled_schema import DecoupledConfig  # noqa: F401  (the decoupled section, in its own module)
from grpo.config.eval_schema import EvalConfig  # noqa: F401  (the eval section, in its own module)
from grpo.config.fields import opt
from grpo.config.fsdp_schema import FsdpConfig  # noqa: F401  (the fsdp section, in its own module)
from grpo.config.loss_schema import LossConfig  # noqa: F401  (the loss section, in its own module)
from grpo.config.rollout_schema import RolloutConfig  # noqa: F401  (the rollout section, in its own module)
from grpo.config.train_schema import TrainConfig  # noqa: F401  (the train section, in its own module)
from grpo.data.sft import RESPONSE_FORMATS
from grpo.data.tags import TAG_STYLES
from grpo.rewards.scoring import RewardSpec


@dataclass
class ModelConfig:
    name_or_path: str = opt("assets/tiny-math", "Policy: a local HF checkpoint folder or a hub id.")
    ref_name_or_path: str | None = opt(
        None, "Reference model for the KL term; null = the policy's initial weights. Must share the tokenizer.")
    lora_r: int = opt(0, "LoRA rank; 0 = full fine-tuning.", ge=0)
    lora_alpha: float = opt(32.0, "LoRA scaling alpha.", gt=0)
    lora_dropout: float = opt(
        0.0, "LoRA dropout; 0 keeps training log-probs equal to the sampler's (ratio 1 on the first pass).",
        ge=0, le=1)
    lora_target_modules: str | list[str] = opt(
        "all-linear", "Modules LoRA adapts: 'all-linear' or a list such as [q_proj, v_proj].")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    bf16: bool = opt(False, "Train in bfloat16 (GPU); fp32 otherwise.")
    fp16: bool = opt(
        False, "float16 mixed precision (TRL's fp16, for GPUs without bf16): fp32 weights (a LoRA run's frozen base "
        "too), float16 compute under torch.autocast, and dynamic loss scaling (torch.amp.GradScaler: the loss is "
        "scaled up in backward, the gradients unscaled before clipping; an update whose gradients overflow is "
        "skipped and the scale halved; its state saved in checkpoints as scaler.pt); under train.deepspeed its "
        "fp16 section (DeepSpeed's own loss scaler). Runs on a CPU too (torch's CPU autocast and GradScaler). "
        "Logs fp16/loss_scale and fp16/overflow_updates; an overflow skipped while the scale is above 1 (its "
        "warm-up from 2^16) does not count toward optim.max_skipped_steps. Not with bf16, load_in_4bit, a critic "
        "(gae) or train.mode decoupled (docs/guides/speed.md).")
    tf32: bool | None = opt(
        None, "TF32 matmuls and cuDNN convolutions (TRL's tf32): true sets torch's fp32 precision to tf32 while the "
        "run trains (transformers' enable_tf32), false to ieee; null leaves torch's setting as it is. Needs an "
        "Ampere or newer CUDA GPU: true is refused on any other device.")
    load_in_4bit: bool = opt(
        False, "QLoRA: the frozen base in 4-bit NF4 (bitsandbytes; CUDA only, refused on CPU); needs lora_r > 0.")
    attn_implementation: str | None = opt(None, "Passed to from_pretrained (e.g. sdpa, flash_attention_2, eager).")
    sdpa_backends: str | None = opt(
        None, "Scaled-dot-product-attention backends the trainer's passes may use, in order of preference, "
        "comma-separated, of flash, efficient, cudnn, math (e.g. efficient,math; flash takes no padding mask); "
        "null = torch's choice per call. Only the sdpa attention reads it (docs/device-choices.md).")
    ref_torch_dtype: str | None = opt(
        None, "dtype of the reference model (float32, bfloat16, float16); null = as the policy.",
        choices=(None, "float32", "bfloat16", "float16"))
    trust_remote_code: bool = opt(False, "Allow model code from the checkpoint folder.")
    lm_head_fp32: bool = opt(
        False, "The LM head in float32, weights and matmul, outside autocast (TRL's cast_lm_head_to_fp32; ScaleRL and "
        "MiniMax-M1: bf16 logits make the trainer's and the sampler's log-probs drift apart): the policy's, the "
        "reference's and the hf / hf-static samplers'. Not for a head LoRA adapts (model.lora_target_modules); a "
        "vLLM sampler keeps its own head (the sampler correction sees the gap).")
    neftune_noise_alpha: float | None = opt(
        None, "NEFTune (transformers' neftune_noise_alpha): uniform noise of scale alpha / sqrt(L x H) on the input "
        "embeddings in the policy's training-mode passes (its log-prob and update passes, not the samplers' "
        "generation nor the reference); null = off.", gt=0)
    disable_dropout: bool = opt(
        False, "Set the rate of every torch.nn.Dropout of the policy (LoRA's included) and of the reference to 0, as "
        "TRL's disable_dropout: a training pass then gives the same log-probs for the same tokens as the sampling "
        "and reference passes (attention dropout set in a model's config is not a Dropout module and stays).")


@dataclass
class DataConfig:
    train: str = opt("synthetic:seed=1,n=5000", (
        "Training prompts: a GSM8K .jsonl/.json/.parquet file, a folder, a hub id (openai/gsm8k), "
        "synthetic:seed=S,n=N[,difficulty=D], arithmetic-tools:seed=S,n=N[,size=large|small|mix] (the "
        "calculator demo's problems), kk:seed=S,n=N[,people=LO-HI] or kk:path=FILE (Knights and Knaves "
        "puzzles, generated or a public K&K file), prompts:path=P[,question_column=C][,answer_column=A] "
        "for any prompt file (plain or chat-message questions, src/tgt multi-turn), or "
        "reasoning_gym:NAME[,size=N,seed=S,<options>][+NAME[*WEIGHT]...] (reasoning-gym's datasets, one or a "
        "weighted mix; pip install 'grpo[envs]')."))
    task: str | None = opt(
        None, "The task (grpo.tasks): gsm8k, arithmetic, kk, reasoning_gym, verifiers, or a dotted path "
        "pkg.module:name to a user's grpo.tasks.Task; null = by data.train (kk: -> kk, reasoning_gym: -> "
        "reasoning_gym, verifiers: -> verifiers, synthetic:/arithmetic-tools: -> arithmetic, else gsm8k). "
        "It loads the data, scores answers in evaluation and gives the default system prompt and rewards; its "
        "rewards and scorer must read the gold the data gives (checked when the config loads).")
    eval: str | dict[str, str] | None = opt(
        None, "Held-out set(s) for eval_steps and the before/after report: a source (metrics eval/accuracy, ...) "
        "or named sources {name: source} (eval/<name>/accuracy, ...; the first is the one early stopping reads), "
        "each read by the task; null = none.")
    split: str = opt("train", "Split to read when data.train is a folder or hub id.")
    eval_split: str = opt("test", "Split to read when data.eval is a folder or hub id.")
    tag_style: str = opt("think", "Answer tags: think (<think>/<answer>) or reasoning (<reasoning>/<answer>).",
                         choices=tuple(TAG_STYLES))
    system_prompt: str | None = opt(None, "System prompt; null = the task's, in data.tag_style's tags.")
    add_system_prompt: bool = opt(True, "Add the system prompt to every prompt; false: no system turn from the run "
                                        "(the chat template's own default, if any; the Python API's datasets carry "
                                        "their own, as TRL's).")
    max_prompt_length: int = opt(512, "Prompts longer than this many tokens are an error.", ge=1)
    train_limit: int | None = opt(None, "Use only the first N training examples.", ge=1)
    eval_limit: int | None = opt(None, "Evaluate only the first N held-out examples (of each set).", ge=1)
    shuffle: bool = opt(True, "Shuffle training prompts each epoch (seeded by train.seed).")


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = opt(
        "grpo", "Outcome advantage per completion: grpo (r - group mean, scaled by loss.scale_rewards), rloo "
        "(r - mean of the group's other completions, unscaled), reinforce_pp (r - group mean, divided by the "
        "batch std of those centred rewards). A batch is one rank's (or one sampler's) rollout batch. Or gae: PPO "
        "with a critic (the critic.* keys), one advantage per token by GAE over the critic's values, whitened over "
        "the rank's batch.",
        choices=tuple(ADVANTAGE_ESTIMATORS))
    gamma: float = opt(1.0, "gae: discount per completion token.", ge=0, le=1)
    lam: float = opt(0.95, "gae: GAE lambda (1: Monte-Carlo returns, 0: one-step TD on the critic).", ge=0, le=1)
    multi_objective_aggregation: str = opt(
        "sum_then_normalize", "Several rewards: sum_then_normalize (each completion's weighted sum of its rewards, "
        "then the estimator's baseline and scaling) or normalize_then_sum (GDPO, grpo estimator only: each reward "
        "centred and scaled by its group's std first, their weighted sum then normalised over the batch). TRL's "
        "multi_objective_aggregation.", choices=tuple(MULTI_OBJECTIVE_AGGREGATIONS))
    kl_penalty: str = opt(
        "loss", "Where loss.beta's KL penalty goes: loss (GRPO: beta * k3 in the loss) or reward (PPO, gae only: "
        "r_t = -beta * (logp_old - logp_ref) per token, plus the completion's reward at its last token).",
        choices=("loss", "reward"))


@dataclass
class CriticConfig:
    name_or_path: str | None = opt(
        None, "gae: the critic's body (a causal LM or reward-model checkpoint; a folder holding "
        "value_head.safetensors, e.g. a grpo checkpoint's critic/, gives the value head too); null = "
        "model.name_or_path. A new value head starts at zero.")
    learning_rate: float = opt(1e-5, "gae: the critic's peak AdamW learning rate (optim's betas and optimizer).",
                               gt=0)
    weight_decay: float = opt(0.0, "gae: the critic's AdamW weight decay.", ge=0)
    warmup_ratio: float = opt(0.0, "gae: share of the critic's updates with linear warm-up.", ge=0, le=1)
    lr_scheduler_type: str = opt(
        "constant", "gae: the critic's decay after warm-up: constant (its targets keep moving with the policy), "
        "linear, cosine or cosine_with_min_lr.",
        choices=tuple(LR_SCHEDULES))
    lr_scheduler_kwargs: dict = opt({}, "gae: the arguments of the critic's decay (as optim.lr_scheduler_kwargs).")
    max_grad_norm: float | None = opt(1.0, "gae: clip the critic's gradient norm; null = no clipping.", gt=0)
    gradient_checkpointing: bool = opt(False, "gae: recompute the critic's activations in backward.")
    lora_r: int = opt(0, "gae: LoRA rank of the critic's body; 0 = full fine-tuning (the value head always trains).",
                      ge=0)
    lora_alpha: float = opt(32.0, "gae: the critic's LoRA alpha.", gt=0)
    lora_dropout: float = opt(0.0, "gae: the critic's LoRA dropout.", ge=0, le=1)
    lora_target_modules: str | list[str] = opt("all-linear", "gae: modules the critic's LoRA adapts.")


@dataclass
class PtxConfig:
    data: str | None = opt(
        None, "PTX (PaddleNLP's pretraining/SFT loss beside RL): prompt/response pairs (a .jsonl/.json/.parquet "
        "file, a folder holding ptx.split's file, or a hub id) whose next-token loss is added to every policy "
        "update, to keep the SFT behaviour and format while RL moves the policy; null = off.")
    coef: float = opt(
        0.1, "Weight of the PTX loss (the mean NLL of the micro-batch's response tokens) added to the policy "
        "loss of each update (PaddleNLP's ptx_coeff). 0.1 keeps RL in charge: on the demo model with pairs in "
        "its own SFT format the PTX gradient is then 0.1-0.3x the policy's; data far from the model (GSM8K prose "
        "on tiny-math: 50-70x at coef 1) needs a smaller one.", gt=0)
    micro_batch_size: int = opt(8, "PTX pairs per rank in one forward/backward, one per optimizer update.", ge=1)
    max_length: int | None = opt(
        None, "Tokens of prompt + response; a longer response loses its end (and its EOS), a pair whose prompt "
        "alone fills it is left out (both counted at start); null = data.max_prompt_length + "
        "rollout.max_completion_length (the longest sequence the RL update sees).", ge=2)
    prompt_column: str = opt(
        "question", "Column with the prompt: text, chat messages ending with a user turn, or src-style user "
        "turns; chat messages ending with the assistant's reply hold the response too (e.g. messages).")
    response_column: str = opt(
        "answer", "Column with the response text (PaddleNLP's tgt: a list ends with the response, the turns "
        "before it go between the src turns).")
    response_format: str = opt(
        "plain", "plain: the response as written; gsm8k: a GSM8K answer ('steps #### N') rewritten in "
        "data.tag_style (<think>steps</think><answer>N</answer>), the format the rewards check.",
        choices=tuple(RESPONSE_FORMATS))
    split: str = opt("train", "Split to read when ptx.data is a folder or hub id.")


@dataclass
class OptimConfig:
    learning_rate: float = opt(1e-6, "Peak AdamW learning rate (full fine-tuning).", gt=0)
    lora_learning_rate: float | None = opt(None, "Learning rate for LoRA parameters; null = learning_rate.", gt=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    adam_beta1: float = opt(0.9, "AdamW beta1.", ge=0, le=1)
    adam_beta2: float = opt(0.99, "AdamW beta2.", ge=0, le=1)
    adam_epsilon: float = opt(1e-8, "AdamW epsilon, added to the denominator (torch's and TRL's default).", gt=0)
    warmup_ratio: float = opt(0.0, "Share of the run's optimizer updates (train.max_steps x loss.num_iterations x "
                                   "train.mini_batches) with linear warm-up.", ge=0, le=1)
    lr_scheduler_type: str = opt(
        "cosine", "Decay after warm-up: constant, linear, cosine (to 0 at the last update) or cosine_with_min_lr (to "
        "a floor: optim.lr_scheduler_kwargs' min_lr or min_lr_rate), as transformers' schedules of those names.",
        choices=tuple(LR_SCHEDULES))
    lr_scheduler_kwargs: dict = opt(
        {}, "Arguments of the decay, transformers' lr_scheduler_kwargs: cosine and cosine_with_min_lr take num_cycles "
        "(0.5: one half-wave; 1.5: down, up and down again), cosine_with_min_lr exactly one of min_lr (a rate) or "
        "min_lr_rate (a share of the peak rate); e.g. {min_lr_rate: 0.1}.")
    max_grad_norm: float | None = opt(1.0, "Clip the global gradient norm; null = no clipping.", gt=0)
    optimizer: str = opt("adamw", "adamw (torch) or adamw_8bit (bitsandbytes 8-bit states; CUDA only, refused on CPU).",
                         choices=("adamw", "adamw_8bit"))
    max_skipped_steps: int = opt(
        3, "Abort after this many consecutive steps whose updates were skipped for NaN/inf gradients (not counting "
        "model.fp16's overflow skips while its loss scale is above 1 and the loss finite: the scaler's warm-up).",
        ge=1)


@dataclass
class LogConfig:
    logging_strategy: str = opt(
        "steps", "When sample completions go to samples.jsonl (and the Python API's TRL log entries are made): steps "
        "(every log.logging_steps), epoch (at the end of each epoch, as train.save_strategy counts them, and at the "
        "last step) or no (never; metrics.jsonl still gets every step). transformers' logging_strategy.",
        choices=("steps", "epoch", "no"))
    logging_steps: int = opt(1, "Write sample completions every N steps (metrics every step).", ge=1)
    routing_mismatch: bool = opt(
        False, "Mixture-of-Experts policies: record the rollout's routing (as loss.routing_replay does) and log "
        "moe/routing_mismatch, the share of (token, layer) routings the update passes choose otherwise, without "
        "replaying it: the measure of what replay would fix. Same engines and modes as loss.routing_replay.")
    num_samples: int = opt(4, "Completions written to samples.jsonl per logged step.", ge=0)
    report_to: list[str] = opt(["tensorboard"], "Trackers: tensorboard, wandb (optional extra), or [] for none.")
    wandb_project: str = opt("grpo", "W&B project when report_to has wandb.")
    progress_bar: bool = opt(True, "Show a rich progress bar.")
    plots: bool = opt(True, "Draw plots/*.png from metrics.jsonl at the end (grpo plot draws them any time).")


@dataclass
class RewardConfig(RewardSpec):
    name: str = opt("answer_correct", "A built-in reward, 'model', 'remote', or a dotted path pkg.module:function.")
    weight: float = opt(1.0, "Weight in the total reward.")
    params: dict = opt({}, "Keyword arguments for the reward (e.g. path, url, timeout); for a dotted path, "
                           "extra keywords on every call.")
    factory_args: dict | None = opt(None, "Dotted path only: the path names a reward factory (e.g. "
                                          "trl.rewards:get_soft_overlong_punishment), called once with these "
                                          "keyword arguments ({} for none) to build the reward.")
    columns: dict = opt({}, "Keyword the reward reads -> dataset column it is read from, e.g. "
                            "{solution: answer} for TRL's accuracy_reward on GSM8K.")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    ptx: PtxConfig = field(default_factory=PtxConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    log: LogConfig = field(default_factory=LogConfig)
    decoupled: DecoupledConfig = field(default_factory=DecoupledConfig)
    rewards: list[RewardConfig] | None = field(default=None, metadata={
        "help": "Reward functions and weights, e.g. [{name: answer_correct, weight: 1.0}]; null or not given = the "
                "task's default rewards (data.task, else by data.train: kk: kk_logic; reasoning_gym: reasoning_gym "
                "+ format_think_answer 0.1; verifiers: none beside the environment's rubric; else answer_correct + "
                "format_think_answer), filled in when the config is resolved (grpo.config.resolve)."})
