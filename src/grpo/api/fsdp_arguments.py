"""FSDP as a TRL user asks for it -> ``train.fsdp`` and the ``fsdp`` section: ``GRPOConfig(fsdp=..., fsdp_config=...)``
read as transformers' ``TrainingArguments`` reads them (``fsdp`` True, an options string or list; ``fsdp_config`` a
dict or a JSON file, its keys with or without ``fsdp_``), or, when ``fsdp`` is not given, what ``accelerate launch``
passes its ranks from an accelerate config file with ``distributed_type: FSDP`` (``ACCELERATE_USE_FSDP``,
``FSDP_VERSION``, ``FSDP_OFFLOAD_PARAMS``, ...), which Trainer's Accelerator reads in that case.

grpo implements FSDP2 (``fully_shard``) over all ranks, one unit per transformer layer class: version 1, hybrid or
no sharding, and size-based wrapping are ValueErrors naming the argument; settings that change nothing grpo
computes (how a checkpoint is typed, loading, FSDP1's prefetch knobs) are accepted as they are.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from grpo.parallel.fsdp import is_sharded

SHARDING = {"full_shard": True, "shard_grad_op": False}  # FSDP2's reshard_after_forward per strategy
NOT_SHARDED_OVER_ALL = ("hybrid_shard", "hybrid_shard_zero2", "no_shard")
# fsdp_config keys that change nothing grpo computes: grpo's checkpoints are always each rank's shards and final/
# the full model; loading and FSDP1's prefetch and parameter-view knobs have no FSDP2 meaning here.
ACCEPTED_AS_IS = ("state_dict_type", "cpu_ram_efficient_loading", "sync_module_states", "use_orig_params",
                  "forward_prefetch", "backward_prefetch", "limit_all_gathers", "xla_fsdp_v2", "xla_fsdp_grad_ckpt")
READ = ("version", "cpu_offload", "offload_params", "reshard_after_forward", "transformer_layer_cls_to_wrap",
        "transformer_cls_names_to_wrap", "auto_wrap_policy", "min_num_params", "activation_checkpointing", "xla")
# accelerate launch's variables (accelerate.utils.launch) -> fsdp_config keys
ACCELERATE_ENV = {"FSDP_VERSION": "version", "FSDP_OFFLOAD_PARAMS": "cpu_offload",
                  "FSDP_RESHARD_AFTER_FORWARD": "reshard_after_forward",
                  "FSDP_TRANSFORMER_CLS_TO_WRAP": "transformer_layer_cls_to_wrap",
                  "FSDP_AUTO_WRAP_POLICY": "auto_wrap_policy", "FSDP_MIN_NUM_PARAMS": "min_num_params",
                  "FSDP_ACTIVATION_CHECKPOINTING": "activation_checkpointing",
                  "FSDP_STATE_DICT_TYPE": "state_dict_type"}


def _truth(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "y", "t"):
        return True
    if text in ("0", "false", "no", "off", "n", "f"):
        return False
    raise ValueError(f"{name}={value!r} is not a true/false value")


def _options(fsdp: Any) -> dict[str, Any]:
    """The ``fsdp`` argument's own options (``"full_shard offload auto_wrap"`` or a list of them)."""
    if fsdp is True:
        return {}
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp)
    keys: dict[str, Any] = {}
    for item in (str(i).lower() for i in items):
        if item in SHARDING:
            keys["reshard_after_forward"] = SHARDING[item]
        elif item == "offload":
            keys["cpu_offload"] = True
        elif item in NOT_SHARDED_OVER_ALL:
            raise ValueError(f"GRPOConfig.fsdp={fsdp!r}: {item} is not supported: grpo's FSDP2 shards over all ranks "
                             f"(full_shard, or shard_grad_op to keep gathered weights from forward to backward)")
        elif item != "auto_wrap":
            raise ValueError(f"GRPOConfig.fsdp={fsdp!r}: unknown option {item!r}; transformers' are full_shard, "
                             "shard_grad_op, offload, auto_wrap")
    return keys


def _config(fsdp_config: dict | str | None, where: str) -> dict[str, Any]:
    """``fsdp_config`` as a dict without the ``fsdp_`` prefixes (a str: a JSON file)."""
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, (str, Path)):
        try:
            fsdp_config = json.loads(Path(fsdp_config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{where}: {fsdp_config} cannot be read as JSON ({err})") from None
    if not isinstance(fsdp_config, dict):
        raise ValueError(f"{where} must be a dict or a JSON file, got {type(fsdp_config).__name__}")
    config = {(k[len("fsdp_"):] if k.startswith("fsdp_") else k): v for k, v in fsdp_config.items()}
    unknown = sorted(set(config) - set(READ) - set(ACCEPTED_AS_IS))
    if unknown:
        raise ValueError(f"{where}: keys {unknown} are not known to grpo; it reads {', '.join(READ)} and accepts "
                         f"{', '.join(ACCEPTED_AS_IS)} as they are")
    return config


def _layer_classes(value: Any) -> list[str]:
    names = value.split(",") if isinstance(value, str) else list(value)
    return [str(n).strip() for n in names if str(n).strip()]


def fsdp_keys(fsdp: Any, fsdp_config: dict | str | None, where: str = "GRPOConfig.fsdp_config") -> dict[str, Any]:
    """grpo's keys for TrainingArguments' ``fsdp`` and ``fsdp_config``; {} when ``fsdp`` is off (None, False, "",
    []). ``model.gradient_checkpointing`` is set only when ``activation_checkpointing`` asks for it (grpo's
    checkpointing under FSDP2 is the model's own). ValueError naming the argument for what grpo cannot do."""
    if not fsdp:
        return {}
    config = {**_options(fsdp), **_config(fsdp_config, where)}
    version = int(config.get("version", 2))
    if version != 2:
        raise ValueError(f"{where}: version {version} is not supported: grpo runs FSDP2 (fully_shard); set version 2 "
                         "(accelerate's config file: fsdp_version: 2)")
    if _truth(config.get("xla", False), f"{where}.xla"):
        raise ValueError(f"{where}: xla is not supported: grpo's FSDP2 runs on torch.distributed (gloo, NCCL)")
    # min_num_params means something under SIZE_BASED_WRAP only (accelerate always passes one)
    policy = str(config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        raise ValueError(f"{where}: auto_wrap_policy {policy} is not supported: grpo makes one FSDP unit per "
                         "transformer layer class (TRANSFORMER_BASED_WRAP, the model's _no_split_modules or "
                         "transformer_layer_cls_to_wrap)")
    keys: dict[str, Any] = {"train.fsdp": True}
    offload = config.get("cpu_offload", config.get("offload_params"))
    if offload is not None:
        keys["fsdp.cpu_offload"] = _truth(offload, f"{where}.cpu_offload")
    reshard = config.get("reshard_after_forward")
    if reshard is not None:  # accelerate writes FSDP1's strategy names here too
        lowered = str(reshard).lower()
        keys["fsdp.reshard_after_forward"] = (SHARDING[lowered] if lowered in SHARDING
                                              else _truth(reshard, f"{where}.reshard_after_forward"))
    classes = config.get("transformer_layer_cls_to_wrap", config.get("transformer_cls_names_to_wrap"))
    if classes:
        keys["fsdp.layer_classes"] = _layer_classes(classes)
    if _truth(config.get("activation_checkpointing", False), f"{where}.activation_checkpointing"):
        keys["model.gradient_checkpointing"] = True
    return keys


def fsdp_arguments(train_fsdp: bool, cpu_offload: bool, reshard_after_forward: bool,
                   layer_classes: list[str]) -> dict[str, Any]:
    """TrainingArguments' ``fsdp`` and ``fsdp_config`` for grpo's keys (``fsdp_keys`` read backwards)."""
    if not train_fsdp:
        return {"fsdp": None, "fsdp_config": None}
    config: dict[str, Any] = {"version": 2, "cpu_offload": cpu_offload, "reshard_after_forward": reshard_after_forward}
    if layer_classes:
        config["transformer_layer_cls_to_wrap"] = list(layer_classes)
    return {"fsdp": True, "fsdp_config": config}


def launcher_fsdp(environ: Mapping[str, str]) -> tuple[bool, dict[str, str]] | None:
    """``(fsdp, fsdp_config)`` from ``accelerate launch``'s environment when its config file asked for FSDP
    (``ACCELERATE_USE_FSDP=true``), else None. accelerate sets ``FSDP_VERSION`` to 1 when the file does not say."""
    if str(environ.get("ACCELERATE_USE_FSDP", "false")).lower() != "true":
        return None
    config = {key: environ[name] for name, key in ACCELERATE_ENV.items() if name in environ}
    config.setdefault("version", "1")
    return True, config


def with_launcher_fsdp(args, environ: Mapping[str, str]):
    """``args`` (a ``GRPOConfig``) with ``accelerate launch``'s FSDP settings when its config file asked for FSDP and
    ``args.fsdp`` is not given (given, it wins, as Trainer's own FSDP plugin does); checked here, so that an
    error names the accelerate config."""
    launched = launcher_fsdp(environ)
    if launched is None or args.fsdp:
        return args
    fsdp, config = launched
    fsdp_keys(fsdp, config, where="accelerate launch's FSDP config (its config file's fsdp_* keys)")
    return dataclasses.replace(args, fsdp=fsdp, fsdp_config=config)


def refuse_shards(model, what: str) -> None:
    """ValueError for ``what`` (save_model(), evaluate()) on a model FSDP2 sharded: after ``train()`` it holds this
    rank's shards, and the ranks' process group is gone."""
    if is_sharded(model):
        raise ValueError(f"{what} after train() with FSDP: the model's parameters are this rank's shards; "
                         "save_final_model=True writes the full model to output_dir/final/ at the end of train() "
                         "(and `grpo export` writes any checkpoint as one)")
