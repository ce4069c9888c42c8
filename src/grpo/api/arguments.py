"""``GRPOConfig``: TRL 1.16's ``GRPOConfig`` argument names, defaults and meanings, for grpo.

Every field a GRPO script passes to TRL is here with TRL's default; where each goes is the one table of
``grpo.api.trl_fields`` (``grpo.api.mapping`` reads it both ways). A TRL field grpo does not implement is refused
by that table's ``UNSUPPORTED`` (a ``ValueError`` naming it and saying why, never a value accepted and ignored); a
name TRL does not have is a ``TypeError``. Fields that cannot change what a run computes (dataloader workers, hub
names while ``push_to_hub`` is off, logging cosmetics) are accepted as they are (``ACCEPTED_AS_IS``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from grpo.algorithm import LOSS_TYPES
from grpo.api.mapping import to_run_config, trl_values, untranslated_keys
from grpo.api.trl_fields import ACCEPTED_AS_IS, UNSUPPORTED
from grpo.config import load_config, run_config_text
from grpo.models.precision import TF32_UNAVAILABLE, tf32_available

@dataclass
class GRPOConfig:
    """TRL 1.16's ``GRPOConfig`` (see the module docstring); grpo's own options at the end."""

    output_dir: str | None = None  # None: "trainer_output" (TRL's)
    # -- the batch (TRL's arithmetic, one generation per grpo step: grpo.api.trl_batch.generation_shape)
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_generations: int = 8
    num_generations_eval: int | None = None  # completions per prompt of the evaluation's loss pass; None: as training
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    max_steps: int = -1
    num_train_epochs: float = 3.0
    # -- optimisation
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | str | None = None  # a dict, or its JSON text (transformers parses "{...}")
    warmup_steps: float = 0
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None  # "key=value,...": parsed as transformers does; AdamW takes nothing from it
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
    activation_checkpointing: bool | None = None  # transformers >= 5.24's name of it: wins where given; mirrors it
    seed: int = 42
    full_determinism: bool = False  # transformers' enable_full_determinism (seeds, deterministic kernels)
    use_cpu: bool = False
    # -- the model
    model_init_kwargs: dict | None = None
    trust_remote_code: bool = False
    disable_dropout: bool = False  # every torch.nn.Dropout of the policy and the reference at rate 0
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
    sync_ref_model: bool = False  # TR-DPO: every ref_model_sync_steps updates, ref = alpha * policy + (1 - alpha) * ref
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
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
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    router_aux_loss_coef: float | None = None  # None: the MoE model config's own (loss.router_aux_loss_coef)
    multi_objective_aggregation: str = "sum_then_normalize"
    # -- launching
    cast_lm_head_to_fp32: bool = False
    neftune_noise_alpha: float | None = None
    vllm_importance_sampling_cap: float | None = None  # TRL's deprecated name of vllm_importance_sampling_clip_max
    deepspeed: str | dict | None = None  # a DeepSpeed JSON file or its contents: train.deepspeed
    fsdp: bool | str | list | None = None  # TrainingArguments': True, "full_shard offload", a list: train.fsdp (FSDP2)
    fsdp_config: dict | str | None = None  # its settings, a dict or JSON file: the fsdp section (api.fsdp_arguments)
    # -- logging, saving, evaluation
    logging_strategy: str = "steps"  # steps, epoch or no (transformers' IntervalStrategy)
    logging_steps: float = 10
    logging_first_step: bool = False
    log_completions: bool = False
    report_to: str | list[str] = "none"
    disable_tqdm: bool | None = None
    save_strategy: str = "steps"  # steps, epoch or no ("best" is refused)
    save_steps: float = 500
    save_total_limit: int | None = None
    eval_strategy: str = "no"  # no, steps or epoch
    eval_steps: float | None = None
    eval_on_start: bool = False
    load_best_model_at_end: bool = False  # end with the best checkpoint's weights (Trainer's _load_best_model)
    metric_for_best_model: str | None = None  # None: "loss" under load_best_model_at_end (transformers' default)
    greater_is_better: bool | None = None  # None: not metric_for_best_model.endswith("loss")
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
            (self.save_strategy in INTERVALS, "save_strategy", "grpo checkpoints by steps, by epoch or not at all "
             "('no'); 'best' (a checkpoint at each new best evaluation) is not implemented"),
            (self.eval_strategy in INTERVALS, "eval_strategy", "one of no, steps, epoch"),
            (self.logging_strategy in INTERVALS, "logging_strategy", "one of no, steps, epoch"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r} is not supported: {why}")
        if self.activation_checkpointing is not None:  # the new name wins, and the old one mirrors it, as there
            self.gradient_checkpointing = self.activation_checkpointing
        self.activation_checkpointing = self.gradient_checkpointing
        self.lr_scheduler_kwargs = scheduler_kwargs(self.lr_scheduler_kwargs)
        best_model_arguments(self)
        optimizer_arguments(self.optim_args)
        if self.generation_batch_size is not None and self.steps_per_generation is not None:  # TRL's words
            raise ValueError("GRPOConfig: 'generation_batch_size' and 'steps_per_generation' can not be both "
                             "configured at the same time")
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


INTERVALS = ("no", "steps", "epoch")


def best_model_arguments(args: GRPOConfig) -> None:
    """transformers' defaults and checks of load_best_model_at_end / metric_for_best_model / greater_is_better
    (``TrainingArguments.__post_init__``): the metric defaults to "loss", greater_is_better to a metric not named
    *loss, and the best checkpoint must be one the run saves (the save and eval strategies agree, save_steps a
    multiple of eval_steps). A ValueError in transformers' words."""
    if args.load_best_model_at_end and args.metric_for_best_model is None:
        args.metric_for_best_model = "loss"
    if args.greater_is_better is None and args.metric_for_best_model is not None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")
    if not args.load_best_model_at_end:
        return
    if args.eval_strategy != args.save_strategy:
        raise ValueError("--load_best_model_at_end requires the save and eval strategy to match, except when "
                         f'--save_strategy="best", but found\n- Evaluation strategy: {args.eval_strategy}\n- Save '
                         f"strategy: {args.save_strategy}")
    eval_steps = args.eval_steps or args.logging_steps  # transformers' fallback for eval_steps
    if args.eval_strategy == "steps" and args.save_steps % eval_steps:
        raise ValueError("--load_best_model_at_end requires the saving steps to be a round multiple of the "
                         f"evaluation steps, but found {args.save_steps}, which is not a round multiple of "
                         f"{eval_steps}.")


def scheduler_kwargs(value: dict | str | None) -> dict | None:
    """TRL's ``lr_scheduler_kwargs`` as a dict: JSON text ``"{...}"`` read as transformers reads it (``"true"``,
    ``"3"``, ``"0.1"`` inside it become a bool, int and float); its names are checked against the schedule when the
    run config is built (``optim.lr_scheduler_kwargs``)."""
    if isinstance(value, str):
        if not value.startswith("{"):
            raise ValueError(f"GRPOConfig.lr_scheduler_kwargs={value!r}: a dict or its JSON text ('{{...}}')")
        value = _typed_strings(json.loads(value))
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"GRPOConfig.lr_scheduler_kwargs={value!r}: a dict or its JSON text ('{{...}}')")
    return value


def _typed_strings(value: dict) -> dict:
    """transformers' ``_convert_str_dict``: string values "true"/"false", "3" and "0.1" as bool, int and float."""
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            item = _typed_strings(item)
        elif isinstance(item, str) and item.lower() in ("true", "false"):
            item = item.lower() == "true"
        elif isinstance(item, str) and item.isdigit():
            item = int(item)
        elif isinstance(item, str) and item.replace(".", "", 1).isdigit():
            item = float(item)
        out[key] = item
    return out


def optimizer_arguments(value: str | None) -> dict[str, str]:
    """TRL's ``optim_args`` ``"key=value,..."`` parsed as transformers parses it (``_parse_optim_args``; a part
    without one ``=`` is a ValueError naming the field). transformers' AdamW (adamw_torch, adamw_torch_fused) and
    bitsandbytes' AdamW 8-bit take nothing from them (they are for AnyPrecisionAdamW, AdEMAMix, GaLore, ...), so
    neither do grpo's AdamW optimizers: the text is accepted as Trainer accepts it, and changes nothing."""
    if not value:
        return {}
    parsed = {}
    for part in value.replace(" ", "").split(","):
        if part.count("=") != 1:
            raise ValueError(f"GRPOConfig.optim_args={value!r}: {part!r} is not key=value (transformers' format "
                             "'key=value,key=value')")
        key, text = part.split("=")
        parsed[key] = text
    return parsed


_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)} - {"extra"}
_OTHER = set(UNSUPPORTED) | set(ACCEPTED_AS_IS)
_generated_init = GRPOConfig.__init__


def _init(self, *args, **kwargs) -> None:
    """TRL's keyword names: known fields, then TRL's unsupported / inert ones into ``extra``."""
    extra = dict(kwargs.pop("extra", None) or {})
    for name in list(kwargs):
        if name not in _FIELDS:
            if name not in _OTHER:
                raise TypeError(f"GRPOConfig got an unexpected argument {name!r}: neither TRL 1.16's GRPOConfig "
                                "nor grpo has it (grpo's config keys go in grpo_overrides)")
            extra[name] = kwargs.pop(name)
    _generated_init(self, *args, extra=extra, **kwargs)


GRPOConfig.__init__ = _init
