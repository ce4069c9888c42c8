"""The sampler role: newest weights -> G completions per prompt -> rewards -> advantages -> old and
reference log-probs -> one rollout batch to the trainer, again and again.

Sampler ``k`` of ``K`` makes batches ``j = 0, 1, ...`` for global step indices ``j*K + k + 1``, with
the colocated trainer's prompts and seeds for that step (one chunk per trainer rank), so one sampler
with ``max_staleness = 0`` reproduces colocated training (dynamic sampling included: each chunk runs the
rounds that trainer rank would). Batch ids are ``sampler-k:j``: a restarted
sampler regenerates from the count the trainer says it trained, and an id trained before is only
acknowledged, never trained twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from grpo.config import RunConfig
from grpo.data.prompt_sampler import PromptSampler
from grpo.decoupled.link_settings import config_fingerprint, max_message_bytes, sampler_curve_key, shared_token
from grpo.decoupled.transport import PeerClosed, RolloutSender
from grpo.models.loading import load_policy, load_reference, load_tokenizer, resolve_device
from grpo.rollout.build import build_engine, holds_own_weights
from grpo.step.batching import concat_batches
from grpo.step.experience import local_reference, rank_experience
from grpo.step.records import RolloutBatch
from grpo.training.settings import dynamic_rounds, experience_settings, logprob_pass, logprob_processing
from grpo.training.setup import build_rewards, load_data
from grpo.weight_store import WeightStore, apply_to_model

logger = logging.getLogger(__name__)


def reference_logprobs_fn(cfg: RunConfig, policy, tokenizer, device, token: str, processing=None):
    """Reference log-probs from the configured server, else from a reference loaded here (following the
    sampling controls in ``processing``; the server does not, see grpo.config.rules); None if beta == 0."""
    if cfg.loss.beta == 0:
        return None
    if cfg.decoupled.ref_server_url:
        from grpo.decoupled.ref_server import RefServerClient

        client = RefServerClient(cfg.decoupled.ref_server_url, token=token or None,
                                 timeout_s=cfg.decoupled.peer_timeout_s, retry_s=cfg.decoupled.ref_server_retry_s)
        client.wait_ready(timeout_s=cfg.decoupled.peer_timeout_s)
        return lambda g: client.logprobs(g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    reference = load_reference(cfg.model, policy, tokenizer, device)
    return local_reference(policy, reference, cfg.rollout.temperature, cfg.train.micro_batch_size, processing,
                           logprob_pass(cfg))


def for_correction(batch: RolloutBatch, correction: bool) -> RolloutBatch:
    """What the trainer gets of the batch's log-probs.

    Correction off: the old log-probs, taken here at this sampler's (maybe stale) weights, are the ratio's
    denominator; nothing else is sent. On (``loss.sampler_is_correction``): the sampler's own log-probs
    travel as ``sampler_logprobs`` (vLLM's when the engine reports them, else those old log-probs of this
    sampler's weights) and ``old_logprobs`` stay empty, so the trainer takes its own at the weights that
    start the update: the ratio then measures the update alone and the truncated weight the staleness.
    """
    if not correction:
        return replace(batch, sampler_logprobs=None)
    sampler = batch.sampler_logprobs if batch.sampler_logprobs is not None else batch.old_logprobs
    return replace(batch, old_logprobs=None, sampler_logprobs=sampler)


def run_sampler(cfg: RunConfig) -> int:
    """Produce batches until the trainer says bye (exit 0) or stays silent past the peer timeout."""
    d = cfg.decoupled
    k, K, W = d.sampler_index, d.num_samplers, d.trainer_ranks
    sampler_id = f"sampler-{k}"
    token = shared_token(cfg)
    device = resolve_device(d.sampler_device)
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    train_set, _ = load_data(cfg)
    prompt_sampler = PromptSampler(len(train_set), cfg.train.prompts_per_step, cfg.train.seed, cfg.data.shuffle)
    policy = load_policy(cfg.model, device).eval()
    policy.requires_grad_(False)
    processing = logprob_processing(cfg, policy, tokenizer)  # old and reference log-probs follow the controls
    ref_logprobs = reference_logprobs_fn(cfg, policy, tokenizer, device, token, processing)
    reward_fns, reward_weights = build_rewards(cfg, train_set)
    engine = build_engine(cfg, policy, tokenizer)
    correction = cfg.loss.sampler_is_correction
    settings = experience_settings(cfg, processing, decoupled_sampler=True,
                                   engine_holds_weights=holds_own_weights(engine))
    store = WeightStore(cfg.train.output_dir)
    curve_key, curve_key_file = sampler_curve_key(cfg)  # None unless decoupled.encrypt
    sender = RolloutSender(d.address, sampler_id, token=token, max_message_bytes=max_message_bytes(cfg),
                           max_inflight=cfg.train.max_staleness + 1, timeout_s=d.peer_timeout_s,
                           config_hash=config_fingerprint(cfg), curve_server_key=curve_key,
                           curve_key_file=curve_key_file)
    welcome = sender.connect(incarnation=int(time.time()))
    loaded_version = 0  # the initial weights (model.name_or_path) are version 0
    j = int(welcome.get("trained_count", 0))
    logger.info("%s connected to %s: policy version %s, resuming at batch %d", sampler_id, d.address,
                welcome.get("policy_version"), j)
    try:
        while True:
            # Run at most max_staleness batches ahead of the trainer, then take the newest weights.
            while sender.inflight > cfg.train.max_staleness:
                sender.poll(timeout_s=1.0)
            newest = max(welcome.get("policy_version", 0), (sender.latest_weights or (0, ""))[0])
            if newest > loaded_version:
                version = store.wait_for_version(newest, timeout_s=d.peer_timeout_s)
                loaded = store.load(version)  # checksums verified before anything is loaded
                apply_to_model(policy, loaded)  # the sampler's old log-probs come from this HF copy
                if holds_own_weights(engine):
                    engine.update_weights(loaded)
                loaded_version = version
            step_index = j * K + k + 1
            started = time.perf_counter()
            chunks, counts = [], []
            for rank in range(W):
                chunk, rollout_stats = rank_experience(
                    engine, policy, ref_logprobs, tokenizer, train_set, prompt_sampler, reward_fns, reward_weights,
                    settings, step=step_index, rank=rank, world_size=W, seed=cfg.train.seed, max_rounds=dynamic_rounds(cfg))
                chunks.append(for_correction(chunk, correction))
                counts.append(rollout_stats)
            batch = concat_batches(chunks, tokenizer.pad_token_id)
            seconds = time.perf_counter() - started
            tokens = float(batch.generation.completion_mask.sum())
            # Dynamic sampling's counts per trainer rank's chunk, averaged (as the colocated ranks' are).
            dynamic = {name: sum(c[name] for c in counts) / W for name in counts[0]}
            sender.send_batch(batch, {"batch_id": f"{sampler_id}:{j}", "policy_version": loaded_version,
                                      "step_index": step_index, "sampler_seconds": seconds,
                                      "sampler_tokens_per_s": tokens / max(seconds, 1e-9), **dynamic})
            j += 1
    except PeerClosed:
        logger.info("%s: the trainer finished; exiting", sampler_id)
        return 0
    finally:
        sender.close(bye=False)


def main(cfg: RunConfig) -> int:
    """Entry point of ``grpo sampler``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.train.seed + cfg.decoupled.sampler_index)
    return run_sampler(cfg)
