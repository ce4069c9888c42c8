"""Load the policy, its tokenizer and the reference model; wrap LoRA. Checks that fail early and say why."""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from grpo.config import ConfigError, ModelConfig
from grpo.config.rules import sdpa_backend_names
from grpo.models.embeddings import add_neftune, head_in_fp32, keep_head_fp32
from grpo.models.architecture import check_lora_targets
from grpo.models.moe import router_logits_off
from grpo.models.precision import autocast_dtype, tf32_mode, uses_autocast
from grpo.models.wrappers import unwrap_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name!r} requested but CUDA is not available on this machine")
    return torch.device(name)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") != 1


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The policy's tokenizer, left padding (for batched generation), a pad token, and a chat template."""
    if _looks_local(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise ConfigError(f"model.name_or_path: {name_or_path!r} does not exist (a local folder or a hub id org/name)")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"model.name_or_path: the tokenizer of {name_or_path!r} has no chat template; "
                          "GRPO prompts are chat messages (use an -Instruct model or add a template)")
    return tokenizer


def _load_causal_lm(name_or_path: str, dtype: torch.dtype, cfg: ModelConfig, key: str):
    if _looks_local(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise ConfigError(f"{key}: {name_or_path!r} does not exist (a local folder or a hub id org/name)")
    kwargs = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)


def _load_4bit(cfg: ModelConfig, device: torch.device):
    """The base in 4-bit NF4 with double quantisation (the QLoRA recipe), compute in bf16/fp32, made
    ready for k-bit training (norms in fp32, input grads for checkpointing) by peft."""
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=policy_dtype(cfg))
    kwargs = {"quantization_config": quantization, "device_map": {"": device.index or 0},
              "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)


def policy_dtype(cfg: ModelConfig) -> torch.dtype:
    """The half type of ``model.bf16``/``model.fp16``, else float32: the weights' dtype where they are not fp32
    master weights under autocast (``uses_autocast``), and the frozen reference copy's."""
    return autocast_dtype(cfg) or torch.float32


def check_memory_savers(model_cfg: ModelConfig, optimizer: str, device: torch.device) -> None:
    """ConfigError (before anything is written) for bitsandbytes options where they cannot run."""
    wanted = [key for key, on in (("model.load_in_4bit", model_cfg.load_in_4bit),
                                  ("optim.optimizer: adamw_8bit", optimizer == "adamw_8bit")) if on]
    if not wanted:
        return
    if device.type != "cuda":
        raise ConfigError(f"{wanted[0]}: bitsandbytes' 4-bit weights and 8-bit optimizer states need a CUDA GPU; "
                          f"this run is on {device.type} (use full precision here, or run on a GPU)")
    try:
        import bitsandbytes  # noqa: F401 (optional: 4-bit loading needs it)
    except ImportError as exc:
        raise ConfigError(f"{wanted[0]}: needs the bitsandbytes package ({exc}); pip install bitsandbytes") from exc


# Attention backends are a device choice: torch's own pick may rebuild an execution plan per new shape
# (cuDNN attention on an H100), which decoding meets every token; see docs/device-choices.md.
def sdpa_backends(names: str | None) -> tuple[str, ...] | None:
    """``"flash,efficient"`` -> ``("FLASH_ATTENTION", "EFFICIENT_ATTENTION")`` (``model.sdpa_backends``, or a
    benchmark's ``--sdpa-backends``): names of SDPBackend, checked; None or ``"auto"``: None (torch's choice)."""
    if names in (None, "auto"):
        return None

    chosen = sdpa_backend_names(names)
    missing = [n for n in chosen if not hasattr(SDPBackend, n)]
    if missing:
        raise ValueError(f"{names!r}: torch {torch.__version__} has no SDPA backend {', '.join(missing)}")
    return chosen


def sdpa_context(backends: tuple[str, ...] | None):
    """A context in which scaled dot product attention uses only ``backends`` (SDPBackend names, in
    that order of preference); a no-op context for None (torch's own choice)."""
    if not backends:
        return nullcontext()

    return sdpa_kernel([getattr(SDPBackend, name) for name in backends], set_priority=True)


class _Contexts:
    """Several context managers entered afresh at each ``with`` (re-enterable, nestable), as one."""

    def __init__(self, *factories):
        self.factories, self.stacks = factories, []

    def __enter__(self):
        stack = ExitStack()
        for factory in self.factories:
            stack.enter_context(factory())
        self.stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self.stacks.pop().__exit__(*exc)


def compute_context(cfg: ModelConfig, device: torch.device, deepspeed: bool):
    """The run's compute settings as one re-enterable context: the autocast of ``uses_autocast`` runs (bf16 or
    fp16), the attention backends of ``model.sdpa_backends`` and the TF32 mode of ``model.tf32``, each where it
    is set (a no-op context when none is)."""
    backends = sdpa_backends(cfg.sdpa_backends)
    factories = []
    if backends:
        factories.append(lambda: sdpa_context(backends))
    if uses_autocast(cfg, deepspeed):
        factories.append(lambda: torch.autocast(device.type, dtype=autocast_dtype(cfg)))
    if cfg.tf32 is not None:
        factories.append(lambda: tf32_mode(cfg.tf32))
    return _Contexts(*factories) if factories else nullcontext()


def load_policy(cfg: ModelConfig, device: torch.device, *, master_weights: bool = False):
    """The trainable policy on ``device``: full model, or a peft LoRA wrapper when ``lora_r > 0``
    (over a 4-bit NF4 base with ``load_in_4bit``: QLoRA). ``master_weights``: load in fp32 whatever
    ``bf16``/``fp16`` say (compute then runs under ``compute_context``)."""
    if cfg.load_in_4bit:
        model = _load_4bit(cfg, device)
    else:
        dtype = torch.float32 if master_weights else policy_dtype(cfg)
        model = _load_causal_lm(cfg.name_or_path, dtype, cfg, "model.name_or_path").to(device)
    return prepare_policy(model, cfg)


def prepare_policy(model: torch.nn.Module, cfg: ModelConfig, device: torch.device | None = None,
                   dtype: torch.dtype | None = None):
    """Make a loaded model the trainable policy, in place where it can: moved to ``device`` in ``dtype``
    (when given), gradient checkpointing as configured, and a LoRA adapter added when ``lora_r > 0``
    unless ``model`` is already a peft model (whose own adapter is then trained). The Python API hands
    its user's model here, so that the user's object ends up holding the trained weights."""
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)

    already_peft = isinstance(model, PeftModel)
    router_logits_off(model)
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if cfg.lora_r > 0 or already_peft:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need grads
    if cfg.lora_r > 0 and not already_peft:
        check_lora_targets(model, cfg.lora_target_modules)
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    if cfg.disable_dropout:  # after LoRA: its dropout modules too, as TRL's (peft wraps before it disables)
        disable_dropout(model)
    if cfg.lm_head_fp32:  # after LoRA: an adapter on the head is refused
        head_in_fp32(model)
    if cfg.neftune_noise_alpha:
        add_neftune(model, cfg.neftune_noise_alpha)
    model.train()
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """Every ``torch.nn.Dropout`` of ``model`` at rate 0 (``model.disable_dropout``; TRL's
    ``disable_dropout_in_model``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0


def load_reference(cfg: ModelConfig, policy: torch.nn.Module, tokenizer, device: torch.device,
                   moving: bool = False):
    """The frozen reference, or None when it is the LoRA policy with its adapter disabled.

    ``ref_name_or_path`` null: the policy's initial weights (a frozen copy, made before any update);
    otherwise another checkpoint that must share the tokenizer (a larger teacher), checked here. ``moving``
    (``loss.ref_sync_steps``): the reference gets weights of its own to move even under LoRA, where it is then a
    copy of the base without the adapter (the same values as the adapter switched off).
    """
    dtype = DTYPES[cfg.ref_torch_dtype] if cfg.ref_torch_dtype else policy_dtype(cfg)
    if cfg.ref_name_or_path is None:
        if cfg.lora_r > 0 and not moving:
            return None  # same weights with the adapter off: no second copy in memory
        copied = copy.deepcopy(unwrap_model(policy))
        reference = (copied.unload() if cfg.lora_r > 0 else copied).to(dtype)  # unload: the base, adapter dropped
        keep_head_fp32(reference)  # a float32 head stays float32 in the copy
    else:
        reference = _load_causal_lm(cfg.ref_name_or_path, dtype, cfg, "model.ref_name_or_path").to(device)
        check_same_vocabulary(cfg, tokenizer, reference)
        if cfg.disable_dropout:  # a copy of the policy has its rates already
            disable_dropout(reference)
        if cfg.lm_head_fp32:
            head_in_fp32(reference)
        router_logits_off(reference)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def check_same_vocabulary(cfg: ModelConfig, tokenizer, reference: torch.nn.Module) -> None:
    """A teacher of another tokenizer family would score other tokens: refuse it with the numbers."""
    ref_tok = AutoTokenizer.from_pretrained(cfg.ref_name_or_path, trust_remote_code=cfg.trust_remote_code)
    if ref_tok.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"model.ref_name_or_path: {cfg.ref_name_or_path!r} has a different tokenizer from the policy "
            f"{cfg.name_or_path!r} ({len(ref_tok)} vs {len(tokenizer)} tokens); the reference must share it")
    rows = reference.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ConfigError(f"model.ref_name_or_path: its embedding has {rows} rows, fewer than the tokenizer's "
                          f"{len(tokenizer)} tokens")


@contextmanager
def reference_context(policy: torch.nn.Module, reference: torch.nn.Module | None):
    """Yield the module that computes reference log-probs: the reference, or the LoRA policy with the
    adapter disabled (peft's ``disable_adapter``)."""
    if reference is not None:
        with nullcontext():
            yield reference
        return

    base = unwrap_model(policy)
    with base.disable_adapter():
        yield base
