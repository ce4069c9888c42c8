"""Code that runs inside vLLM's worker processes: the full-weight reload grpo pushes policies through.

vLLM's RL pattern (``examples/offline_inference/rlhf_utils.py``, and every RL framework on vLLM) is a
*worker extension*: a class named by ``vllm.LLM(worker_extension_cls="module.Class")`` that vLLM mixes
into its worker class, whose methods the trainer then calls by name through ``LLM.collective_rpc``.
This module is that class. It is imported by qualified name in every worker process, so it imports
nothing of grpo's and nothing heavy at module level.

Why not call the worker's ``reload_weights`` alone (vLLM 0.24 to 0.32 all have it: an in-place,
layer-by-layer reload that re-runs each layer's ``process_weights_after_loading``)? Because it leaves a
*tied* output head stale on the CPU backend, and the sampler then draws from a model that is half the
new policy and half the old one:

* With ``tie_word_embeddings`` (Qwen2.5 up to 3B, Llama 3.2 1B/3B, the tests' tiny model), vLLM's
  ``lm_head`` is a ``ParallelLMHead`` whose ``weight`` *is* ``embed_tokens.weight``; the checkpoint has
  no ``lm_head.weight`` and the model's ``load_weights`` skips the ``lm_head.`` prefix.
* On the CPU backend ``UnquantizedEmbeddingMethod.process_weights_after_loading`` packs the weight into
  a oneDNN matmul handle (``dispatch_cpu_unquantized_gemm``: ``layer.cpu_linear``, a *copy* of the
  weight), and the logits are computed with that copy.
* The reload finds no weights for ``lm_head`` ("ParallelLMHead: Failed to load weights" in its log), puts
  its old tensors back and never re-runs its processing. ``embed_tokens`` is reloaded and re-packed, and
  as the storage is shared, ``lm_head.weight`` holds the new values too, but its packed copy, the one
  the logits use, is the old head.

On CUDA the head's ``apply`` reads ``layer.weight`` itself (no packed copy), so the shared storage is
enough there. Re-processing the tied head is then a no-op, so the same code runs on both. How a model
ties is vLLM's choice per release: from 0.28 Qwen2 builds a ``ParallelLMHead`` sharing the embedding's
weight (stale on CPU), 0.24-0.27 make ``lm_head`` the embedding module itself (one module, reloaded once:
nothing to refresh). ``tied_layers`` finds either by parameter identity, so no version switch is needed.
"""

from __future__ import annotations

import torch


def tied_layers(model: torch.nn.Module) -> list[str]:
    """Names of the modules that share a parameter with another module (a tied output head and the
    embedding it is tied to: ``["model.embed_tokens", "lm_head"]``), in module order. All members are
    returned, not only the one a reload skips: which one the checkpoint names is up to the model."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(name)
    shared = {name for names in holders.values() if len(names) > 1 for name in names}
    return [name for name, _ in model.named_modules() if name in shared]


def refresh_tied_layers(model: torch.nn.Module) -> list[str]:
    """Re-run the post-load processing of every tied layer of ``model`` from its (shared, reloaded)
    weight; returns their names. Only unquantized layers are handled: re-processing one is idempotent
    (on CPU it packs the current weight again; elsewhere it does nothing), while processing a quantized
    layer twice would quantize its quantized weights again. grpo publishes unquantized weights."""
    # vLLM: the optional extra; this module runs inside its workers
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    refreshed = []
    for name in tied_layers(model):
        module = model.get_submodule(name)
        method = getattr(module, "quant_method", None)
        if method is None:
            continue  # a plain module computes with its parameters themselves: the shared storage suffices
        if not isinstance(method, UnquantizedEmbeddingMethod):
            raise RuntimeError(f"vLLM layer {name!r} shares its weights with another layer and uses "
                               f"{type(method).__name__}; grpo can refresh only unquantized tied layers after "
                               "a weight reload")
        method.process_weights_after_loading(module)
        refreshed.append(name)
    return refreshed


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def grpo_reload_weights(self, weights_path: str) -> list[str]:
        """Load every weight from ``weights_path``'s safetensors in place, then refresh the tied layers
        (see the module docstring). Returns the refreshed layers' names."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)  # vLLM's in-place reload
        # `model_runner.model` is how vLLM's own RLHF examples reach the model from a worker extension.
        return refresh_tied_layers(self.model_runner.model)

    def grpo_tied_layers(self) -> list[str]:
        """The modules of the served model that share weights with another module (see ``tied_layers``)."""
        return tied_layers(self.model_runner.model)
