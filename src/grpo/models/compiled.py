"""``train.torch_compile``: the policy's decoder (embeddings, layers, final norm) through ``torch.compile`` while
the update's micro-batches run, and only then.

Why the decoder and not the whole model or each layer: the fused LM head reads the final hidden states with a
hook on the decoder, which stays outside the compiled code (only ``forward`` is swapped, hooks run around it), and
the LM head and the log-prob math stay eager. Compiling each layer instead breaks under Hugging Face's gradient
checkpointing (the compiled layer's recompute saves other tensors than its first run: torch's CheckpointError),
and the shared prompt pass reads each layer's KV cache by its layer index, which dynamo specialises on: one graph
per layer, past its recompile limit of 8 on real models. The whole decoder is one graph per kind of call, with
the checkpointing traced into it. Sampling and the no-grad passes (reference, old log-probs, evaluation) call
the same modules uncompiled: they run other shapes (one token per decode step) the update never runs.

Shapes vary with every micro-batch (rows, prompt and completion widths), so the graphs are compiled with
``dynamic=True``: one graph per kind of call (plain pass, shared prompt pass, packed pass; a size of 1 is
specialised, as torch does), not one per shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._inductor import list_mode_options  # a mode's options, as torch.compile(mode=m) expands them; loaded by
# transformers' model classes already (about 1 s on its own), and every process that compiles has loaded those

from grpo.config import ConfigError
from grpo.models.wrappers import decoder

DEFAULT_BACKEND = "inductor"  # torch.compile's and TRL's default


@dataclass(frozen=True)
class CompileSettings:
    """``train.torch_compile_backend`` (None: inductor) and ``train.torch_compile_mode`` (None: torch's)."""

    backend: str | None = None
    mode: str | None = None


def check_compile(settings: CompileSettings) -> None:
    """ConfigError (before anything is written) for a backend this torch does not have."""
    known = torch.compiler.list_backends(exclude_tags=())  # with the debug ones (aot_eager, eager)
    if (settings.backend or DEFAULT_BACKEND) not in known:
        raise ConfigError(f"train.torch_compile_backend: {settings.backend!r} is not a torch.compile backend of "
                          f"torch {torch.__version__}; known: {', '.join(known)}")


def _compiled(forward, settings: CompileSettings, device_type: str):
    backend = settings.backend or DEFAULT_BACKEND
    if backend == "inductor" and device_type == "cpu":
        # torch 2.11's C++ code generation places the bounds check of an indirect load before the index it
        # checks, in a vectorised loop with dynamic shapes (the padding-mask lookup of transformers' causal mask
        # builder): a C++ compile error on the second shape. The check is a debug assertion (the ids and masks
        # index inside their tensors by construction), so the CPU graphs are built without it. A mode is the
        # same as its options (torch.compile takes one or the other).
        options = {**list_mode_options(settings.mode or "default"), "assert_indirect_indexing": False}
        return torch.compile(forward, backend=backend, dynamic=True, options=options)
    return torch.compile(forward, backend=backend, mode=settings.mode, dynamic=True)


class CompiledDecoder:
    """The decoder of ``model`` (a causal LM, maybe under peft/DDP) and its compiled ``forward``, built once (a
    new ``torch.compile`` wrapper would start over: dynamo's cached graphs belong to the backend that built
    them); ``active()`` runs the decoder compiled inside its block."""

    def __init__(self, model: torch.nn.Module, settings: CompileSettings):
        self.module = decoder(model)
        device_type = next(self.module.parameters()).device.type
        self.forward = _compiled(self.module.forward, settings, device_type)

    @contextmanager
    def active(self) -> Iterator[None]:
        # An instance attribute shadows the class's forward (nn.Module calls self.forward); deleting it
        # brings the eager one back, exceptions included.
        self.module.forward = self.forward
        try:
            yield
        finally:
            del self.module.forward
