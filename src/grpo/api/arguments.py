"""``GRPOConfig``: TRL 1.16's ``GRPOConfig`` argument names, defaults and meanings, for grpo.

Every field a GRPO script passes to TRL is here with TRL's default (``grpo.api.mapping`` turns them into the
config tree ``grpo train`` reads). A TRL field grpo does not implement is here too, so that setting it is a
``ValueError`` naming it and saying why, never a value accepted and ignored; a name TRL does not have is a
``TypeError``. Fields that cannot change what a run computes (dataloader workers, hub names while
``push_to_hub`` is off, logging cosmetics) are accepted as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from grpo.algorithm import LOSS_TYPES
from grpo.api.mapping import to_run_config, trl_values, untranslated_keys
from grpo.config import load_config, run_config_text
from grpo.models.precision import TF32_UNAVAILABLE, tf32_available

# Fields grpo does not implement: (TRL's default, why). Setting one to anything else is a ValueError.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "router_aux_loss_coef": (None, "grpo adds no MoE load-balancing loss"),
    "disable_dropout": (False, "grpo trains with the model's own dropout settings"),
    "cast_lm_head_to_fp32": (False, "grpo computes log-probs in fp32 from the model's own head"),
    "num_generations_eval": (None, "grpo's evaluation samples eval.num_samples (grpo_overrides) beside greedy"),
    "vllm_mode": ("colocate", "grpo's vLLM runs colocated; a separate sampler is train.mode: decoupled"),
    "vllm_structured_outputs_regex": (None, "grpo has no constrained decoding"),
    "vllm_tensor_parallel_size": (1, "grpo's vLLM engine runs on one device"),
    "sync_ref_model": (False, "grpo's reference stays fixed (or is a teacher); no TR-DPO refresh"),
    "use_adaptive_entropy": (False, "grpo's entropy bonus has a fixed coefficient (entropy_coef)"),
    "log_completions_hub_repo": (None, "grpo writes samples to samples.jsonl, never to the Hub"),
    "full_determinism": (False, "grpo seeds everything but does not force deterministic kernels"),
    "push_to_hub": (False, "grpo never uploads; save_model() and push the folder yourself"),
    "load_best_model_at_end": (False, "grpo keeps the last weights"),
    "neftune_noise_alpha": (None, "grpo adds no embedding noise"),
    "auto_find_batch_size": (False, "TRL refuses it for GRPO too"),
    "lr_scheduler_kwargs": (None, "grpo's schedules take no extra arguments"),
    "logging_strategy": ("steps", "grpo logs by steps"),
    "deepspeed": (None, "grpo's DeepSpeed is for the decoupled trainer ranks (grpo_overrides train.deepspeed)"),
    "fsdp": (None, "grpo has no FSDP"),
    "optim_args": (None, "grpo's optimizers take their settings from the fields (adam_beta1, ...)"),
    "optim_target_modules": (None, "grpo's optimizers apply to every trainable parameter"),
    "parallelism_config": (None, "grpo runs data-parallel ranks only (torchrun)"),
    "fsdp_config": (None, "grpo has no FSDP"),
    "vllm_importance_sampling_cap": (None, "TRL's deprecated name: use vllm_importance_sampling_clip_max"),
    "use_transformers_paged": (None, "TRL's deprecated name of use_transformers_continuous_batching"),
}
ACCEPTED_AS_IS = (  # cannot change what a run computes
    "ds3_gather_for_generation", "pad_to_multiple_of", "cache_implementation", "vllm_model_impl",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_max_model_length", "ref_model_mixup_alpha", "ref_model_sync_steps", "entropy_coef_min",
    "entropy_coef_max", "entropy_coef_delta", "entropy_target", "log_multimodal", "num_completions_to_print",
    "log_unique_prompts", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "gradient_checkpointing_kwargs", "data_seed", "dataloader_drop_last",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "run_name", "project", "logging_dir",
    "logging_nan_inf_filter", "include_num_input_tokens_seen", "save_only_model", "torch_empty_cache_steps",
    "ddp_find_unused_parameters", "ddp_timeout", "log_level", "overwrite_output_dir", "log_on_each_node",
    "log_level_replica", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "eval_delay",
    "prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
    "include_for_metrics", "batch_eval_metrics", "save_on_each_node", "hub_always_push", "hub_revision",
    "metric_for_best_model", "greater_is_better", "ignore_data_skip", "restore_callback_states_from_checkpoint",
    "dataloader_multiprocessing_context", "dataloader_in_order", "label_names", "length_column_name",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "skip_memory_metrics",
    "do_train", "do_eval", "do_predict", "local_rank", "debug", "average_tokens_across_devices", "use_cache",
    "bf16_full_eval", "fp16_full_eval", "label_smoothing_factor", "train_sampling_strategy", "accelerator_config",
    "resume_from_checkpoint", "enable_jit_checkpoint", "activation_checkpointing_kwargs",
)


@dataclass
class GRPOConfig:
    """TRL 1.16's ``GRPOConfig`` (see the module docstring); grpo's own options at the end."""

    output_dir: str | None = None  # None: "trainer_output" (TRL's)
    # -- the batch (TRL's arithmetic: grpo.api.mapping.batch_shape)
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_generations: int = 8
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    max_steps: int = -1
    num_train_epochs: float = 3.0
    # -- optimisation
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    optim: str = "adamw_torch_fused"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    bf16: bool | None = None  # None: True where CUDA has bf16, unless fp16 (TRL raises without use_cpu there)
    fp16: bool = False  # model.fp16: fp32 weights, float16 autocast, dynamic loss scaling (a CPU too)
    tf32: bool | None = None  # model.tf32; None: on with torch_compile on a TF32 GPU (transformers' rule), else as is
    torch_compile: bool = False  # train.torch_compile (on when a backend or mode is given, as TRL)
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    use_liger_kernel: bool = False  # train.fused_lm_head: true (grpo's chunked head; Liger's layer kernels: no)
    liger_kernel_config: dict | None = None  # refused where it asks for a Liger kernel (a key set True)
    gradient_checkpointing: bool = True
    seed: int = 42
    use_cpu: bool = False
    # -- the model
    model_init_kwargs: dict | None = None
    trust_remote_code: bool = False
    # -- sampling
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None
    chat_template_kwargs: dict | None = None
    shuffle_dataset: bool = True
    remove_unused_columns: bool = False
    use_vllm: bool = False
    vllm_enable_sleep_mode: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    # -- the loss
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    scale_rewards: str | bool = "group"
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True
    reward_weights: list[float] | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    multi_objective_aggregation: str = "sum_then_normalize"
    # -- logging, saving, evaluation
    logging_steps: float = 10
    logging_first_step: bool = False
    log_completions: bool = False
    report_to: str | list[str] = "none"
    disable_tqdm: bool | None = None
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_on_start: bool = False
    per_device_eval_batch_size: int = 8  # completions per batch of the evaluation's loss pass (eval_loss)
    max_tool_calling_iterations: int | None = None  # tool rounds after the first turn; None: until the length budget
    # -- grpo's own options (not TRL's)
    advantage_estimator: str = "grpo"  # a grpo.algorithm.ADVANTAGE_ESTIMATORS name (gae: PPO with a critic)
    rollout_engine: str | None = None  # a rollout.engine value (grpo.config.kinds); None: auto (vllm: use_vllm=True)
    dynamic_sampling: bool = False  # DAPO's: resample groups whose rewards are all equal
    ptx_data: str | None = None  # an SFT file whose NLL is added to the loss (PaddleNLP's PTX)
    ptx_coef: float | None = None  # its weight; None: grpo's default (ptx.coef)
    save_final_model: bool = False  # also save the model to output_dir/final/ at the end (TRL: save_model())
    plot_at_end: bool = False  # draw output_dir/plots/*.png at the end (any time: trainer.plot())
    grpo_overrides: dict[str, Any] = field(default_factory=dict)  # any grpo config key: {"train.eval_steps": 5}

    # TRL's fields grpo does not implement, and those accepted as they are (all at TRL's defaults)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name, value in self.extra.items():
            if name in UNSUPPORTED and value != UNSUPPORTED[name][0]:
                raise ValueError(f"GRPOConfig.{name}={value!r} is not supported by grpo: {UNSUPPORTED[name][1]} "
                                 f"(TRL's default {UNSUPPORTED[name][0]!r} is)")
        checks = [
            (self.loss_type in LOSS_TYPES, "loss_type", f"grpo implements {', '.join(LOSS_TYPES)}"),
            (self.steps_per_generation in (None, self.gradient_accumulation_steps), "steps_per_generation",
             "a grpo step updates on its whole rollout batch: steps_per_generation must equal "
             "gradient_accumulation_steps (TRL's default)"),
            (self.save_strategy == "steps", "save_strategy",
             "grpo checkpoints every save_steps and at the end ('steps')"),
            (self.eval_strategy in ("no", "steps"), "eval_strategy", "grpo evaluates by steps ('steps') or not ('no')"),
            (self.adam_epsilon == 1e-8, "adam_epsilon", "grpo's AdamW uses torch's eps 1e-8"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r} is not supported: {why}")
        self._check_precision_and_kernels()
        unknown = set(self.generation_kwargs or {}) - {"min_new_tokens"}
        if unknown:
            raise ValueError(f"GRPOConfig.generation_kwargs {sorted(unknown)} are not supported: grpo reads "
                             "min_new_tokens there; top_k/top_p/min_p/repetition_penalty are fields of their own")
        unknown = set(self.model_init_kwargs or {}) - {"dtype", "torch_dtype", "attn_implementation",
                                                      "trust_remote_code"}
        if unknown:
            raise ValueError(f"GRPOConfig.model_init_kwargs {sorted(unknown)} are not supported: grpo reads dtype, "
                             "attn_implementation and trust_remote_code there")

    def _check_precision_and_kernels(self) -> None:
        """fp16/bf16 and tf32 as TrainingArguments checks them (its words), liger_kernel_config's kernels."""
        if self.fp16 and self.bf16:
            raise ValueError("GRPOConfig: at most one of fp16 and bf16 can be True, but not both")
        if self.tf32 and not tf32_available():
            raise ValueError(f"GRPOConfig.tf32=True: {TF32_UNAVAILABLE}")
        asked = sorted(name for name, on in (self.liger_kernel_config or {}).items() if on)
        if asked:
            raise ValueError(f"GRPOConfig.liger_kernel_config {asked} is not supported: grpo applies none of Liger's "
                             "kernels; use_liger_kernel=True runs grpo's chunked LM head (train.fused_lm_head), "
                             "whose log-probs never build the [B, L, V] logits")

    def __getattr__(self, name: str) -> Any:  # TRL's other fields read back as given (or TRL's default)
        extra = self.__dict__.get("extra", {})
        if name in extra:
            return extra[name]
        if name in UNSUPPORTED:
            return UNSUPPORTED[name][0]
        raise AttributeError(f"GRPOConfig has no field {name!r}")

    @classmethod
    def from_yaml(cls, path) -> "GRPOConfig":
        """A recipe of ``grpo train`` as a ``GRPOConfig`` (``to_run_config`` gives the recipe's config back)."""
        return cls.from_run_config(load_config(path))

    @classmethod
    def from_run_config(cls, cfg) -> "GRPOConfig":
        """TRL-named arguments for a grpo config, with every key TRL cannot say in ``grpo_overrides``
        (``grpo.api.mapping``: ``from_run_config(cfg).to_run_config() == cfg``)."""
        args = cls(**trl_values(cfg))
        args.grpo_overrides = untranslated_keys(cfg, args.to_run_config())
        return args

    def to_run_config(self, num_processes: int = 1, train_size: int | None = None):
        """The ``RunConfig`` ``grpo train`` would run (``grpo.api.mapping.to_run_config``)."""
        return to_run_config(self, num_processes=num_processes, train_size=train_size)

    def to_yaml(self, path, num_processes: int = 1, train_size: int | None = None) -> str:
        """Write the recipe ``grpo train`` runs for these arguments; returns its text."""
        return run_config_text(self.to_run_config(num_processes, train_size), path)


_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)} - {"extra"}
_OTHER = set(UNSUPPORTED) | set(ACCEPTED_AS_IS)
_generated_init = GRPOConfig.__init__


def _init(self, *args, **kwargs) -> None:
    """TRL's keyword names: known fields, then TRL's unsupported / inert ones into ``extra``."""
    extra = dict(kwargs.pop("extra", None) or {})
    if "activation_checkpointing" in kwargs:  # transformers 5's name of gradient_checkpointing
        kwargs.setdefault("gradient_checkpointing", kwargs.pop("activation_checkpointing"))
    for name in list(kwargs):
        if name not in _FIELDS:
            if name not in _OTHER:
                raise TypeError(f"GRPOConfig got an unexpected argument {name!r}: neither TRL 1.16's GRPOConfig "
                                "nor grpo has it (grpo's config keys go in grpo_overrides)")
            extra[name] = kwargs.pop(name)
    _generated_init(self, *args, extra=extra, **kwargs)


GRPOConfig.__init__ = _init
