"""Where a trained model lives, and loading it for inference (evaluate, chat, export).

A model path given on the command line may be:
- a Hugging Face model folder (``config.json`` + weights),
- a LoRA adapter folder (``adapter_config.json``; the base is its ``base_model_name_or_path``),
- a run folder: ``RUN/final/`` when present, else the newest ``RUN/checkpoints/step-N/``.

A run's ``config.yaml`` (in the run folder, or in the model folder itself) supplies the system
prompt and answer tag style the model was trained with, so that evaluation and chat ask for the
same format the reward checked.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from grpo.config import ConfigError, RunConfig, load_config
from grpo.data import resolve_system_prompt
from grpo.models.loading import DTYPES, load_tokenizer, resolve_device
from grpo.tasks import run_system_prompt

ADAPTER_CONFIG = "adapter_config.json"
RUN_CONFIG = "config.yaml"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location. No loading happens here.

    model_dir:     the folder holding the weights (a full model, or the LoRA adapter).
    base_model:    for a LoRA adapter, the base model folder or hub id; None for a full model.
    tokenizer_dir: the folder or hub id the tokenizer is read from.
    run_dir:       the run folder the model belongs to, when it is part of one.
    config:        the run's config (from ``config.yaml``), or None when there is none.
    """

    model_dir: Path
    base_model: str | None
    tokenizer_dir: str
    run_dir: Path | None
    config: RunConfig | None

    @property
    def is_adapter(self) -> bool:
        return self.base_model is not None

    @property
    def tag_style(self) -> str:
        """The run's answer tag style; "think" (the config default) without a run config."""
        return self.config.data.tag_style if self.config is not None else "think"

    @property
    def system_prompt(self) -> str | None:
        """The system prompt the model was trained with: the run's (``data.system_prompt``, else its task's,
        ``grpo.tasks.run_system_prompt``), or the think style's default for a model without a run config; None:
        the run added none (``data.add_system_prompt: false``)."""
        return run_system_prompt(self.config) if self.config is not None else resolve_system_prompt(None, "think")

    def describe(self) -> str:
        """One line saying what will be loaded, for logs and reports."""
        what = f"LoRA adapter {self.model_dir} on {self.base_model}" if self.is_adapter else str(self.model_dir)
        return what + (f" (run {self.run_dir})" if self.run_dir is not None else "")


def holds_model(folder: Path) -> bool:
    """True when ``folder`` has a LoRA adapter config, or a model config.json with weight files."""
    if (folder / ADAPTER_CONFIG).is_file():
        return True
    return (folder / "config.json").is_file() and any(any(folder.glob(p)) for p in WEIGHT_PATTERNS)


def _holds_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def find_model_dir(path: Path) -> tuple[Path, Path | None]:
    """The folder with the weights for ``path`` and the run folder it belongs to (or None).

    A run folder resolves to ``final/`` when it holds a model, else to the newest
    ``checkpoints/step-N/`` (by N) that holds one; newer step folders without a model (a checkpoint
    still being written, or torn) are skipped with a warning on stderr.
    """
    if holds_model(path):
        return path, _run_dir_of(path)
    final = path / "final"
    if holds_model(final):
        return final, path
    steps = _step_dirs(path / "checkpoints")
    if steps:
        complete = [d for d in steps if holds_model(d)]
        if not complete:
            raise ConfigError(f"{path}: none of the checkpoints in {path / 'checkpoints'} holds a model "
                              f"(looked at {', '.join(d.name for d in steps)}: no config.json + weights or "
                              f"{ADAPTER_CONFIG})")
        skipped = [d.name for d in steps if not holds_model(d) and _step(d) > _step(complete[-1])]
        if skipped:
            print(f"grpo: warning: skipping checkpoint folder(s) without a model: {', '.join(skipped)}; "
                  f"using {complete[-1].name}", file=sys.stderr)
        return complete[-1], path
    raise ConfigError(
        f"{path}: holds no model: expected a HF model folder (config.json + *.safetensors), a LoRA adapter "
        f"folder ({ADAPTER_CONFIG}) or a run folder with final/ or checkpoints/step-N/")


def _step(folder: Path) -> int:
    match = STEP_DIR.match(folder.name)
    assert match is not None
    return int(match.group(1))


def _step_dirs(checkpoints: Path) -> list[Path]:
    """``step-N`` folders sorted by N (numerically: step-10 after step-9)."""
    if not checkpoints.is_dir():
        return []
    return sorted((d for d in checkpoints.iterdir() if d.is_dir() and STEP_DIR.match(d.name)), key=_step)


def _run_dir_of(model_dir: Path) -> Path | None:
    """The run folder of ``RUN/final`` or ``RUN/checkpoints/step-N``; None for a lone model folder."""
    if model_dir.name == "final":
        return model_dir.parent
    if STEP_DIR.match(model_dir.name) and model_dir.parent.name == "checkpoints":
        return model_dir.parent.parent
    return None


def _read_run_config(model_dir: Path, run_dir: Path | None) -> RunConfig | None:
    """The config.yaml next to the weights, else the run folder's; None when neither exists."""
    for folder in (model_dir, run_dir):
        if folder is not None and (folder / RUN_CONFIG).is_file():
            try:
                return load_config(folder / RUN_CONFIG)
            except ConfigError as err:
                raise ConfigError(f"the run config of {model_dir} could not be read: {err}") from None
    return None


def _adapter_base(model_dir: Path, config: RunConfig | None, base_model: str | None) -> str:
    """The base model of a LoRA adapter: the override, the adapter's own record, or the run config's."""
    if base_model is not None:
        return base_model
    recorded = json.loads((model_dir / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    if recorded:
        return recorded
    if config is not None:
        return config.model.name_or_path
    raise ConfigError(f"{model_dir / ADAPTER_CONFIG}: base_model_name_or_path is empty and there is no run "
                      "config.yaml naming the base model; pass the base model explicitly")


def resolve_model_source(path: str | Path, base_model: str | None = None) -> ModelSource:
    """Find the model for ``path`` (a model, adapter, checkpoint or run folder) and its run config.

    base_model: overrides the base of a LoRA adapter (e.g. when the base was moved after training).
    Raises ConfigError when ``path`` does not exist or holds no model.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"model path {str(path)!r} does not exist (a model, checkpoint or run folder)")
    if not path.is_dir():
        raise ConfigError(f"model path {str(path)!r} is a file; give the folder that holds the model")
    model_dir, run_dir = find_model_dir(path)
    config = _read_run_config(model_dir, run_dir)
    base = _adapter_base(model_dir, config, base_model) if (model_dir / ADAPTER_CONFIG).is_file() else None
    if _holds_tokenizer(model_dir):
        tokenizer_dir = str(model_dir)
    elif base is not None:
        tokenizer_dir = base  # an adapter's tokenizer is its base's: LoRA does not change the vocabulary
    elif config is not None:
        tokenizer_dir = config.model.name_or_path  # training never changes the tokenizer
    else:
        raise ConfigError(f"{model_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) and no run config "
                          "naming the base model to take the tokenizer from")
    return ModelSource(model_dir=model_dir, base_model=base, tokenizer_dir=tokenizer_dir, run_dir=run_dir,
                       config=config)


def inference_dtype(source: ModelSource, dtype: str | None) -> torch.dtype:
    """``dtype`` by name; None = the run's training dtype (bfloat16 when model.bf16), else float32."""
    if dtype is None:
        return torch.bfloat16 if source.config is not None and source.config.model.bf16 else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model_for_inference(source: ModelSource, device: torch.device | str = "cpu", dtype: str | None = None,
                             merge: bool = True):
    """Load ``(model, tokenizer)`` in eval mode on ``device``, gradients off.

    A LoRA adapter is loaded onto its base with ``PeftModel.from_pretrained`` and, with ``merge``,
    folded into the base weights (``merge_and_unload``): generation then runs at the speed of the
    plain model, and the result is a plain ``PreTrainedModel`` (what ``export`` saves).
    """
    device = resolve_device(device) if isinstance(device, str) else device
    torch_dtype = inference_dtype(source, dtype)
    trust = source.config.model.trust_remote_code if source.config is not None else False
    tokenizer = load_tokenizer(source.tokenizer_dir, trust_remote_code=trust)
    if source.is_adapter:
        base_path = source.base_model
        assert base_path is not None
        try:
            base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch_dtype, trust_remote_code=trust)
        except OSError as err:  # not a local folder, and not a hub id in the cache / reachable
            raise ConfigError(f"{source.model_dir / ADAPTER_CONFIG}: base model {base_path!r} could not be "
                              f"loaded ({err}); pass the base model explicitly") from None
        model = PeftModel.from_pretrained(base, str(source.model_dir), is_trainable=False)
        if merge:
            model = model.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.model_dir), dtype=torch_dtype,
                                                     trust_remote_code=trust)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer
