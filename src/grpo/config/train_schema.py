"""The ``train`` section of the config tree (``grpo.config.schema``): the step's batch and how the update runs
through it, the run's length, checkpoints and evaluation schedule, and the decoupled trainer's staleness."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.fields import opt


@dataclass
class TrainConfig:
    mode: str = opt("colocated", "colocated: one command does everything; decoupled: sampler and trainer processes.",
                    choices=("colocated", "decoupled"))
    prompts_per_step: int = opt(8, "P: prompts per optimisation step (over all ranks); P*G completions.", ge=1)
    micro_batch_size: int = opt(16, "Completions per forward/backward; gradients accumulate over an update's "
                                    "mini-batch (the whole step's batch with train.mini_batches 1).", ge=1)
    mini_batches: int = opt(
        1, "Optimizer updates per pass over a step's rollout batch (PPO mini-batches; TRL's steps_per_generation / "
        "gradient_accumulation_steps; verl's batch / ppo_mini_batch_size). Updates per step = loss.num_iterations x "
        "mini_batches, each over prompts_per_step / mini_batches prompts' completions (each rank: its share / "
        "mini_batches), whole groups dealt round-robin (group i to mini-batch i mod mini_batches); the advantages "
        "stay those of the whole step, and every update's ratio is to the weights that started the step (a no-grad "
        "pass when the rollout brought no old log-probs). Each update's loss is its mini-batch's (dapo's token "
        "normaliser: the step's tokens / mini_batches, as TRL's). Must divide train.prompts_per_step (in decoupled "
        "mode each trainer rank's share); not with decoupled.partial_rollouts.", ge=1)
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
    max_steps: int = opt(100, "Optimisation steps to run; each is one rollout batch and loss.num_iterations x "
                              "train.mini_batches optimizer updates (the learning-rate schedule counts updates).",
                         ge=1)
    output_dir: str = opt("runs/demo", "Run folder: config, metrics, samples, plots, checkpoints.")
    seed: int = opt(42, "Seed for data order, sampling and initialisation.", ge=0)
    full_determinism: bool = opt(
        False, "transformers' enable_full_determinism at the start of every process: train.seed into Python, numpy "
        "and torch, deterministic torch kernels only (an op without one is an error), cuDNN deterministic without "
        "benchmarking, CUBLAS_WORKSPACE_CONFIG=:16:8 and CUDA_LAUNCH_BLOCKING=1 (slower: each kernel launch waits). "
        "For bit-for-bit reruns on GPUs; CPU runs are deterministic without it.")
    save_strategy: str = opt(
        "steps", "When the run checkpoints: steps (every train.save_steps and at the end), epoch (at the end of each "
        "epoch, every len(data.train) // prompts_per_step steps as TRL counts an epoch, and at the end), or no (never: "
        "no checkpoint, not at a stop or Ctrl-C either, nothing to resume; final/ and best/ are written as "
        "train.save_final and train.best_metric say). transformers' save_strategy.", choices=("steps", "epoch", "no"))
    save_steps: int = opt(50, "Checkpoint every N steps (and at the end).", ge=1)
    save_total_limit: int | None = opt(2, "Keep only the newest N checkpoints; null = all.", ge=1)
    eval_strategy: str = opt(
        "steps", "When data.eval is evaluated during training: steps (every train.eval_steps) or epoch (at the end of "
        "each epoch, as train.save_strategy counts them, and at the last step; needs train.eval_steps: null); "
        "train.eval_on_start and train.eval_at_end add theirs. transformers' eval_strategy.",
        choices=("steps", "epoch"))
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
    load_best_at_end: bool = opt(
        False, "At the end, load the weights of best/ (train.best_metric's; the evaluation before training is a "
        "candidate too) into the model before final/ is saved, as transformers' load_best_model_at_end does with its "
        "best checkpoint; needs train.best_metric. The Python API's load_best_model_at_end is Trainer's own.")
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
    deepspeed: str | dict | None = opt(
        None, "DeepSpeed: a JSON config file (or the config as a mapping, as TRL's deepspeed= takes it) for the "
        "trainer ranks, colocated or decoupled (configs/ds_zero2.json, ds_zero3.json); its batch fields 'auto' or "
        "equal to the run's; null = torch (DDP on N ranks).")
    fsdp: bool = opt(
        False, "PyTorch FSDP2 for the trainer ranks, colocated or decoupled: parameters, gradients and optimizer "
        "state sharded over the ranks (fully_shard per decoder layer, then the root; options in the fsdp section), "
        "checkpoints written as each rank's shards (torch.distributed.checkpoint) that resume at any rank count.")
    max_staleness: int = opt(
        0, "Decoupled: how many policy versions (steps, not optimizer updates) a rollout may lag; 0 = on-policy at "
        "the step's first update (its later updates, num_iterations x mini_batches - 1 of them, are off-policy by "
        "the step's own updates, which the clipped ratio to the step's start covers).", ge=0)
    sync_steps: int = opt(1, "Decoupled: publish weights every N steps; one version per step, after all its "
                             "loss.num_iterations x train.mini_batches updates.", ge=1)
