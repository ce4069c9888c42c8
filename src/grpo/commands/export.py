"""``grpo export``: a checkpoint (full or LoRA) -> a plain Hugging Face model folder.

The result loads with ``AutoModelForCausalLM.from_pretrained`` alone (no peft): a LoRA adapter is
merged into its base (``merge_and_unload``) before saving. Weights are written as safetensors, with
the tokenizer beside them. The folder is written under a temporary name and renamed at the end, so
an interrupted export never leaves a half-written model under ``out_dir``. An FSDP2 checkpoint (each rank's
shards) is read by ``grpo.commands.sharded_export``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from grpo.compat import save_pretrained
from grpo.commands.sharded_export import load_sharded_model, shards_of
from grpo.config import ConfigError
from grpo.models.source import load_model_for_inference, resolve_model_source


def _is_inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def export_model(
    checkpoint: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    overwrite: bool = False,
    base_model: str | None = None,
) -> Path:
    """Write the model of ``checkpoint`` (a model, adapter, checkpoint or run folder) to ``out_dir``.

    dtype: "float32" | "bfloat16" | "float16"; None = the run's training dtype (float32 without a run
    config). overwrite: replace a non-empty ``out_dir`` (refused otherwise). base_model: the base of a
    LoRA adapter when its recorded path moved. Returns ``out_dir``.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"export: {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"export: {out_dir} is not empty; choose another folder or pass overwrite")
    shards = shards_of(Path(checkpoint).expanduser())
    if shards is None:
        source = resolve_model_source(checkpoint, base_model=base_model)
        inputs = [source.model_dir] + ([Path(source.base_model)] if source.base_model and
                                       Path(source.base_model).exists() else [])
    else:
        inputs = [Path(checkpoint).expanduser(), shards]
    # Replacing out_dir deletes it: never when it holds what is being exported.
    for folder in inputs:
        if _is_inside(folder.resolve(), out_dir):
            raise ConfigError(f"export: {out_dir} contains the model being exported ({folder}); choose another folder")

    if shards is None:
        model, tokenizer = load_model_for_inference(source, "cpu", dtype, merge=True)
    else:
        model, tokenizer = load_sharded_model(Path(checkpoint).expanduser(), shards, dtype)
    lora_keys = [k for k in model.state_dict() if "lora_" in k]
    if lora_keys:  # merge_and_unload left adapter layers behind: the result would need peft to load
        raise RuntimeError(f"export: merged model still has LoRA weights, e.g. {lora_keys[0]}")

    staging = out_dir.with_name(out_dir.name + ".export-tmp")
    if staging.exists():
        shutil.rmtree(staging)  # left by an interrupted export of this same out_dir
    staging.mkdir(parents=True)
    save_pretrained(model, staging)  # safetensors: the only format transformers 5 writes
    tokenizer.save_pretrained(staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir
