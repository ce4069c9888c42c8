"""The one place where grpo depends on which release of a library is installed.

grpo's dependencies are ranges (pyproject.toml; docs/getting-started/install.md), tested at both ends. Where a release
in a range behaves differently, the difference is handled here, as a question the rest of the code asks,
rather than as version comparisons scattered through it; tests/test_compat.py covers each branch.

* transformers 5.23 made ``generate`` leave each row's left padding out of the repetition penalty
  (``RepetitionPenaltyLogitsProcessor(prompt_ignore_length=<first real position per row>)``). Before, the
  pad token counted as seen in every left-padded row, so ``generate`` sampled from a distribution other
  than the one the trainer computes log-probs for (``grpo.algorithm.processing`` never counts padding).
  ``generate_repetition_penalty`` gives older releases the same penalty through a logits processor.
* transformers 5.24 renamed the models' ``past_key_values`` (the argument and the output field) to
  ``cache``; the old name warns there and goes in 5.40, while 5.17-5.23 silently ignore ``cache=`` (their
  forward takes ``**kwargs``). ``cache_argument`` and ``returned_cache`` use the installed release's name.
* transformers' ``save_pretrained`` (5.x) first passes the model through ``modeling_utils.unwrap_model``, which
  asks accelerate, which imports deepspeed when it is installed (0.2-0.6 s, once per process) only to test
  whether the model is a ``DeepSpeedEngine``, which a ``PreTrainedModel`` never is. ``save_pretrained`` skips that
  for a model grpo has unwrapped itself; a release without ``unwrap_model`` saves as it is.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from torch import Tensor
import transformers.modeling_utils
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from grpo.algorithm.processing import penalize_repeats

GENERATE_SKIPS_LEFT_PADDING = (5, 23)  # the transformers release from which generate does it itself
CACHE_RENAMED = (5, 24)  # the transformers release whose models take and return ``cache``


def _parse_release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string; a pre-release of 5.23 (5.23.0.dev0) counts as 5.23."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


# Read once at import: the compiled decode step (torch.compile) asks model_cache_name on every call, and
# dynamo on torch 2.11 cannot trace the import a lazy lookup would make.
INSTALLED_TRANSFORMERS = _parse_release(transformers.__version__)


def _release(version: str | None) -> tuple[int, int]:
    """(major, minor) of the transformers release named, or of the installed one (None)."""
    return INSTALLED_TRANSFORMERS if version is None else _parse_release(version)


def generate_skips_left_padding(transformers_version: str | None = None) -> bool:
    """Whether ``generate`` leaves each row's left padding out of the repetition penalty (the installed
    transformers, or the release named)."""
    return _release(transformers_version) >= GENERATE_SKIPS_LEFT_PADDING


def model_cache_name(transformers_version: str | None = None) -> str:
    """The name a model's forward takes its KV cache by, and returns it under."""
    return "cache" if _release(transformers_version) >= CACHE_RENAMED else "past_key_values"


def cache_argument(cache: Any, transformers_version: str | None = None) -> dict[str, Any]:
    """``model(..., **cache_argument(cache))``: the KV cache to continue from, by the installed release's name."""
    return {model_cache_name(transformers_version): cache}


def returned_cache(output: Any, transformers_version: str | None = None) -> Any:
    """The KV cache a model's forward returned (``use_cache=True``), None when it returned none."""
    return getattr(output, model_cache_name(transformers_version), None)


class PaddingFreeRepetitionPenalty(LogitsProcessor):
    """HF's repetition penalty with each row's tokens before ``first_real[row]`` not counted as seen
    (what transformers 5.23's ``prompt_ignore_length`` does), for older releases' ``generate``."""

    def __init__(self, penalty: float, first_real: Tensor):
        self.penalty = penalty
        self.first_real = first_real  # [rows] the first real position of each (expanded) row

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        vocab = scores.shape[-1]
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        ids = input_ids.masked_fill(columns < self.first_real.to(input_ids.device)[:, None], vocab)
        seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
        return penalize_repeats(scores, seen[:, :vocab], self.penalty)


def generate_repetition_penalty(config: GenerationConfig, attention_mask: Tensor,
                                transformers_version: str | None = None
                                ) -> tuple[GenerationConfig, LogitsProcessorList]:
    """``generate``'s ``generation_config`` and ``logits_processor`` for ``config``'s repetition penalty,
    left padding (``attention_mask`` [prompts, Lp], 0 on padding) not counted: ``config`` as it is where
    ``generate`` does this itself; before transformers 5.23 a copy without the penalty, and a processor that
    applies it. Both sit where ``generate`` puts its own penalty: after the other processors, before the
    temperature and the top-k/top-p/min-p warpers (the penalty commutes with min_new_tokens' ``-inf``)."""
    penalty = config.repetition_penalty
    if penalty is None or penalty == 1.0 or generate_skips_left_padding(transformers_version):
        return config, LogitsProcessorList()
    first_real = (attention_mask != 0).int().argmax(dim=1).repeat_interleave(config.num_return_sequences or 1)
    without = copy.deepcopy(config)
    without.repetition_penalty = 1.0
    return without, LogitsProcessorList([PaddingFreeRepetitionPenalty(penalty, first_real)])


def save_pretrained(model: torch.nn.Module, folder: Any, **kwargs: Any) -> None:
    """``model.save_pretrained(folder, **kwargs)`` for a model already out of its DDP wrapper (a
    ``PreTrainedModel`` or a PEFT model), without the deepspeed import described above."""
    with _pretrained_models_unwrap_as_themselves():
        model.save_pretrained(folder, **kwargs)


@contextlib.contextmanager
def _pretrained_models_unwrap_as_themselves() -> Iterator[None]:
    # transformers looks the function up in its module's globals at each call, so replacing it there for
    # the call's length is enough; anything but a PreTrainedModel still goes to the original.
    original = getattr(transformers.modeling_utils, "unwrap_model", None)
    if original is None:
        yield
        return

    def unwrap_model(model: torch.nn.Module, recursive: bool = False) -> torch.nn.Module:
        if isinstance(model, PreTrainedModel) and not recursive:
            return model
        return original(model, recursive=recursive)

    transformers.modeling_utils.unwrap_model = unwrap_model
    try:
        yield
    finally:
        transformers.modeling_utils.unwrap_model = original
