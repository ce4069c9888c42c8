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
from grpo.config.eval_schema import EvalConfig  # noqa: F401  (the eval section, in its own module)
from grpo.config.fields import opt
from grpo.config.loss_schema import LossConfig  # noqa: F401  (the loss section, in its own module)
from grpo.config.rollout_schema import RolloutConfig  # noqa: F401  (the rollout section, in its own module)
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
        "constant", "gae: the critic's decay after warm-up: constant (its targets keep moving with the policy), linear "
        "or cosine.",
        choices=tuple(LR_SCHEDULES))
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
    warmup_ratio: float = opt(0.0, "Share of max_steps with linear warm-up.", ge=0, le=1)
    lr_scheduler_type: str = opt("cosine", "Decay after warm-up: constant, linear or cosine (to 0 at the last "
                                            "update).", choices=tuple(LR_SCHEDULES))
    max_grad_norm: float | None = opt(1.0, "Clip the global gradient norm; null = no clipping.", gt=0)
    optimizer: str = opt("adamw", "adamw (torch) or adamw_8bit (bitsandbytes 8-bit states; CUDA only, refused on CPU).",
                         choices=("adamw", "adamw_8bit"))
    max_skipped_steps: int = opt(
        3, "Abort after this many consecutive steps whose updates were skipped for NaN/inf gradients (not counting "
        "model.fp16's overflow skips while its loss scale is above 1 and the loss finite: the scaler's warm-up).",
        ge=1)


@dataclass
class TrainConfig:
    mode: str = opt("colocated", "colocated: one command does everything; decoupled: sampler and trainer processes.",
                    choices=("colocated", "decoupled"))
    prompts_per_step: int = opt(8, "P: prompts per optimisation step (over all ranks); P*G completions.", ge=1)
    micro_batch_size: int = opt(16, "Completions per forward/backward; gradients accumulate over a step.", ge=1)
    shared_prompt_pass: bool | None = opt(
        None, "Log-prob passes run each distinct prompt of a micro-batch once and its completions over the "
        "prompt's KV cache (true), or every prompt + completion as one sequence (false): the same values, G "
        "times less prompt compute for a second forward per micro-batch; null = the device type's default "
        "(CPU: true; CUDA: false, where the second forward's host work costs more; docs/device-choices.md).")
    column_bucket: int | None = opt(
        None, "Log-prob passes round the columns they run (beyond the padding every row of a micro-batch shares) "
        "up to a multiple of this, so shapes repeat and GPU kernels and attention plans are reused; the extra "
        "columns are masked padding. null = the device type's default (CUDA: 64, others: 1).", ge=1)
    max_tokens_per_micro_batch: int | str | None = opt(
        "auto", "Update micro-batches by padded tokens (rows by length while rows x (longest prompt + completion) "
        "fits; the same gradient): auto = the padded tokens of the step's largest micro_batch_size-row micro-batch, "
        "any number of rows (never more memory, fewer passes when lengths vary; fixed rows with deepspeed and on "
        "CUDA, where repeated shapes run faster); N = that budget, at most micro_batch_size rows (not with "
        "deepspeed); null: micro_batch_size rows.")
    pack_sequences: bool = opt(
        False, "Log-prob passes run each micro-batch's rows as one packed sequence of real tokens (no padding; "
        "replaces the shared prompt pass; for flash-attention-2's varlen kernels). Same values.")
    fused_lm_head: bool | None = opt(
        None, "Log-probs from the final hidden states, the LM head chunked and recomputed in backward (no [b, L, V] "
        "logits); null: when a micro-batch's logits would reach 2^26 elements (CUDA's no-grad passes: 2^30). "
        "Same values.")
    torch_compile: bool = opt(
        False, "Compile the policy's decoder (embeddings, layers, final norm) with torch.compile for the update's "
        "forward and backward passes (the loss passes and PTX), dynamic shapes; sampling, the reference and the "
        "no-grad log-prob passes run it uncompiled. Same values up to float re-association. Not with deepspeed. "
        "It is for CUDA: on the 2-core CPU (smoke-cpu recipe, tiny-math, inductor, torch 2.11) the update after "
        "warm-up took 0.89-1.05x the eager one's time while compiling cost 92 s first and 20 s again at step 11: a "
        "12-step run 125 s instead of 12 s (docs/benchmarks.md).")
    torch_compile_backend: str | None = opt(
        None, "train.torch_compile's backend (torch.compiler.list_backends(); e.g. inductor, aot_eager); null = "
        "inductor.")
    torch_compile_mode: str | None = opt(
        None, "train.torch_compile's mode; null = torch's default.",
        choices=(None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    max_steps: int = opt(100, "Optimisation steps to run.", ge=1)
    output_dir: str = opt("runs/demo", "Run folder: config, metrics, samples, plots, checkpoints.")
    seed: int = opt(42, "Seed for data order, sampling and initialisation.", ge=0)
    save_steps: int = opt(50, "Checkpoint every N steps (and at the end).", ge=1)
    save_total_limit: int | None = opt(2, "Keep only the newest N checkpoints; null = all.", ge=1)
    eval_steps: int | None = opt(
        None, "Evaluate data.eval every N steps (and at start and end); null = start/end only.", ge=1)
    eval_on_start: bool = opt(True, "Evaluate before the first step of a new run (when data.eval is set).")
    eval_at_end: bool = opt(True, "Evaluate once more after the last step (when data.eval is set); false: the "
                                  "last step is evaluated inside it, before its checkpoint, as TRL's Trainer does "
                                  "(the Python API's default).")
    early_stop_accuracy: float | None = opt(
        None, "Stop when eval/accuracy (named sets: the first set's) reaches this value.", ge=0, le=1)
    best_metric: str | None = opt(
        None, "Keep the weights of the evaluation that is best by this logged metric (e.g. eval/accuracy, "
        "eval/gsm8k/pass@4) in <output_dir>/best/ (with best.json: step, value); null = off.")
    best_metric_mode: str = opt("max", "train.best_metric: max (higher is better) or min.", choices=("max", "min"))
    resume: bool = opt(False, "Continue from the newest checkpoint in output_dir.")
    resume_from: str | None = opt(
        None, "Continue from this checkpoint folder of output_dir instead of the newest (implies train.resume); "
        "another run's checkpoint folder starts a new run in output_dir from its weights, optimizer and step.")
    checkpoint_layout: str = opt(
        "grpo", "Checkpoint folders: grpo (checkpoints/step-N) or trl (checkpoint-<optimizer update>/ with "
        "transformers' trainer_state.json, as TRL writes them; the Python API's).", choices=("grpo", "trl"))
    save_final: bool = opt(True, "Save the trained model (or adapter) to output_dir/final/ at the end.")
    overwrite: bool = opt(False, "Allow writing into an output_dir that holds another run.")
    device: str = opt("auto", "auto (cuda if available), cpu, or cuda[:N].")
    fast_exit: bool = opt(True, "At exit, collect once then gc.freeze, so Python's shutdown skips the heap (~1 s less; "
                                "live objects in cycles are not finalized; not with a nanobind extension loaded).")
    deepspeed: str | None = opt(None, "DeepSpeed JSON config (decoupled trainer ranks).")
    max_staleness: int = opt(0, "Decoupled: how many policy versions a rollout may lag; 0 = on-policy.", ge=0)
    sync_steps: int = opt(1, "Decoupled: publish weights every N steps.", ge=1)


@dataclass
class DecoupledConfig:
    address: str = opt("tcp://127.0.0.1:5555", "ZeroMQ address the trainer's rank 0 binds and samplers connect to; "
                                               "with host 0.0.0.0 samplers read the trainer's address from the run "
                                               "folder (decoupled/trainer_address.json).")
    advertise_host: str | None = opt(None, "Host samplers on other machines reach trainer rank 0 at, published in the "
                                           "run folder (null: this host's name, if it resolves beyond loopback).")
    trainer_ranks: int = opt(1, "Trainer processes (data-parallel ranks) the launcher starts with torchrun.", ge=1)
    num_samplers: int = opt(1, "Sampler processes the launcher starts (each its own data shard and seed).", ge=1)
    sampler_index: int = opt(0, "This sampler's index (set by the launcher for each sampler process).", ge=0)
    sampler_device: str = opt("auto", "Device of the samplers (auto, cpu, cuda:N).")
    ref_server: bool = opt(
        False, "Start a reference log-prob server; samplers query it instead of loading the reference.")
    ref_server_url: str | None = opt(
        None, "URL of a running reference server (set by the launcher when it starts one).")
    ref_server_port: int = opt(
        8431, "Port of the reference server (on decoupled.ref_server_host).", ge=1, le=65535)
    ref_server_device: str = opt("auto", "Device of the reference server.")
    ref_server_host: str = opt("127.0.0.1", "Address `grpo ref-server` binds; another host's samplers need a "
                                            "reachable one (e.g. 0.0.0.0), which needs decoupled.token_env.")
    ref_server_retry_s: float = opt(
        60.0, "A sampler keeps retrying an unreachable reference server this long (a restart) before it exits.",
        ge=0)
    token_env: str | None = opt(None, "Environment variable holding the shared token for ZeroMQ and the ref server.")
    encrypt: bool = opt(False, "Encrypt the ZeroMQ link with CURVE (the batches hold prompts and completions); "
                               "every role must agree. The token still says who may send.")
    curve_dir: str | None = opt(None, "Folder of the trainer's CURVE key pair (server.key, server.key_secret), "
                                      "seen by every role; null = decoupled/curve in train.output_dir.")
    queue_size: int = opt(4, "Rollout batches the trainer holds before samplers are told to wait (backpressure).", ge=1)
    peer_timeout_s: float = opt(600.0, "Give up (with a clear error) after waiting this long for a peer.", gt=0)
    max_message_mb: int = opt(1024, "Largest accepted message (MiB); larger ones are rejected.", ge=1)
    weights_keep: int = opt(3, "Published weight versions kept on disk.", ge=1)
    weight_sync: str = opt(
        "files", "How samplers get new weights: files (the weight store in the run folder) or broadcast (full "
                 "fine-tuning only: a gloo group of trainer rank 0 and the samplers; files after a failure).",
        choices=("files", "broadcast"))
    weight_sync_port: int = opt(29600, "Port of trainer rank 0's TCPStore for decoupled.weight_sync: broadcast "
                                       "(samplers reach it at the trainer's host: the one decoupled.address names "
                                       "or, with a wildcard address, the one rank 0 publishes in "
                                       "decoupled/trainer_address.json of the run folder; the group's keys derive "
                                       "from decoupled.token_env's token, and without one the store listens on "
                                       "127.0.0.1 only).",
                                ge=1, le=65535)
    restart_samplers: bool = opt(True, "The launcher restarts a sampler that dies.")
    weight_update: str = opt(
        "per_chunk", "When a sampler loads newer weights: per_chunk (before each chunk; a chunk is made by one "
                     "version) or in_flight (also while generating: every decoupled.inflight_check_tokens tokens it "
                     "loads the newest published version in place and continues the open sequences, KV caches kept "
                     "(vLLM with LoRA re-admits them under the new adapter); each token records its version and "
                     "log-prob). in_flight needs rollout.engine hf, hf-static or vllm (full weights or LoRA; vllm "
                     "with top_p/top_k only under loss.sampler_is_correction), single-turn rollouts, min_p 0.",
        choices=("per_chunk", "in_flight"))
    inflight_check_tokens: int = opt(
        16, "decoupled.weight_update in_flight: a sampler looks for newer weights every this many generated tokens.",
        ge=1)
    partial_rollouts: bool = opt(
        False, "Partial rollouts: a sampler sends a chunk after decoupled.partial_token_budget tokens of generation "
               "(more only while no group has finished or more than a chunk's prompts would stay behind) with the "
               "prompt groups whose G completions all ended; a group with a completion still running is carried "
               "over and finished in the sampler's next chunk. Each token keeps the version and log-prob of the "
               "weights that drew it; a carried group with a token older than train.max_staleness allows starts "
               "over. Several trainer ranks split a step's groups as evenly as whole groups allow, each rank's "
               "loss scaled to its share (under DeepSpeed a rank with fewer micro-batches runs zero-gradient ones "
               "to match). Needs train.max_staleness >= 1 (about num_samplers + 1 for carried groups to survive), "
               "rollout.engine hf, hf-static or vllm (as for in_flight), single-turn rollouts, rollout.min_p 0, "
               "no dynamic sampling.")
    partial_token_budget: int = opt(
        32, "decoupled.partial_rollouts: tokens each running completion gets per chunk before the chunk is sent "
            "(below rollout.max_completion_length).", ge=1)


@dataclass
class LogConfig:
    logging_steps: int = opt(1, "Write sample completions every N steps (metrics every step).", ge=1)
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
    log: LogConfig = field(default_factory=LogConfig)
    decoupled: DecoupledConfig = field(default_factory=DecoupledConfig)
    rewards: list[RewardConfig] | None = field(default=None, metadata={
        "help": "Reward functions and weights, e.g. [{name: answer_correct, weight: 1.0}]; null or not given = the "
                "task's default rewards (data.task, else by data.train: kk: kk_logic; reasoning_gym: reasoning_gym "
                "+ format_think_answer 0.1; verifiers: none beside the environment's rubric; else answer_correct + "
                "format_think_answer), filled in when the config is resolved (grpo.config.resolve)."})
