"""The trainer role: receive rollout batches (rank 0), give each rank its slice, update, publish weights.

Rank 0 owns the ZeroMQ receiver and the weight store; it hands every batch to the other ranks as
wire-format bytes over the process group (never pickle). A batch is acknowledged after it was trained,
provisionally until a checkpoint lists it (the sampler keeps it until then, to resend after a crash);
the trained batch ids go into every checkpoint, so a restarted trainer only acknowledges a batch it
trained before. A batch more than ``train.max_staleness`` versions behind is dropped and counted.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from grpo.config import RunConfig, config_to_dict
from grpo.decoupled.link_settings import max_message_bytes, shared_token
from grpo.decoupled.transport import IncomingBatch, PeerTimeout
from grpo.decoupled.wire import batch_to_message, decode, encode, message_to_batch, pack_bytes, unpack_bytes
from grpo.models.loading import check_memory_savers, compute_context, load_policy, load_tokenizer, uses_autocast
from grpo.run.resume import resume_checkpoint, save_run_checkpoint
from grpo.run.run_dir import check_output_dir, claim_output_dir
from grpo.step.batching import rank_slice
from grpo.step.metrics import sample_records, step_metrics
from grpo.step.policy_update import train_on_batch
from grpo.training.distributed import DistInfo, barrier, print0, shutdown
from grpo.training.guards import DeferredInterrupt, SkipGuard
from grpo.training.settings import logprob_processing, loss_settings
from grpo.training.setup import build_trainable, load_ptx_data, start_process

logger = logging.getLogger(__name__)


def share_batch(incoming: IncomingBatch | None, info: DistInfo, device: torch.device, max_bytes: int):
    """Rank 0's batch on every rank: wire-format bytes broadcast as a uint8 tensor (length first)."""
    if not info.enabled:
        return incoming.batch, incoming.meta
    if info.is_main:
        header, tensors = batch_to_message(incoming.batch, incoming.meta)
        data = torch.frombuffer(bytearray(pack_bytes(encode("batch", header, tensors))), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    size = size.to(comm_device)
    dist.broadcast(size, src=0)
    if not info.is_main:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    data = data.to(comm_device)
    dist.broadcast(data, src=0)
    message = decode(unpack_bytes(data.cpu().numpy().tobytes()), max_bytes=max_bytes)
    return message_to_batch(message)


def publish_weights(store, trainable, version: int, keep: int, info: DistInfo) -> str:
    """Write weights ``version`` (rank 0; gathered from every rank first under ZeRO-3)."""
    from grpo.training.learners import zero3_full_state_dict
    from grpo.weight_store import state_dict_for_publish

    gathered = zero3_full_state_dict(trainable.learner)  # a collective under ZeRO-3
    path = ""
    if info.is_main:
        state, kind, adapter_config = state_dict_for_publish(trainable.policy)
        if gathered is not None and kind == "full":
            state = gathered  # ZeRO-3: the local parameters are empty shards
        # Own copies: DeepSpeed keeps parameters as views of one flat buffer (shared storage).
        state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        path = str(store.publish(version, state, kind=kind, adapter_config=adapter_config, keep=keep))
    barrier(info)
    return path


def next_fresh_batch(receiver, step: int, cfg: RunConfig, counters: dict) -> tuple[IncomingBatch, float]:
    """The next batch at most ``max_staleness`` versions old (older ones are dropped and counted),
    with the seconds spent waiting. Waiting longer than the peer timeout is an error, not a hang."""
    started = time.perf_counter()
    last_status = started
    while True:
        incoming = receiver.next_batch(timeout_s=1.0)
        now = time.perf_counter()
        if incoming is None:
            if now - started > cfg.decoupled.peer_timeout_s:
                raise PeerTimeout(f"no rollout batch from any sampler for {now - started:.0f} s "
                                  f"(decoupled.peer_timeout_s); samplers: {list(receiver.peers())}")
            if now - last_status > 30:
                logger.warning("step %d: waiting for rollouts for %.0f s (samplers: %s)", step, now - started,
                               list(receiver.peers()) or "none connected")
                last_status = now
            continue
        staleness = (step - 1) - incoming.policy_version
        if staleness > cfg.train.max_staleness:
            receiver.drop(incoming.batch_id, f"stale: sampled with version {incoming.policy_version}, "
                          f"trainer at {step - 1}, max_staleness {cfg.train.max_staleness}")
            counters["dropped"] += 1
            continue
        return incoming, now - started


def run_trainer(cfg: RunConfig) -> int:
    """Train ``train.max_steps`` steps on batches from the samplers; returns the exit status."""
    from grpo.decoupled.transport import RolloutReceiver
    from grpo.run.checkpoint import save_final
    from grpo.run.plots import plot_run
    from grpo.run.tracking import MetricsLogger
    from grpo.training.learners import zero3_full_state_dict
    from grpo.weight_store import WeightStore

    info, device = start_process(cfg)
    receiver = None
    try:
        if info.world_size != cfg.decoupled.trainer_ranks:
            raise ValueError(f"decoupled.trainer_ranks is {cfg.decoupled.trainer_ranks} but {info.world_size} "
                             "ranks were launched; samplers cut batches by trainer_ranks")
        if info.is_main:
            check_output_dir(cfg)
        torch.manual_seed(cfg.train.seed)
        tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
        ptx_data = load_ptx_data(cfg, tokenizer, info)  # PTX pairs (ptx.data): the trainer ranks' own data
        check_memory_savers(cfg.model, cfg.optim.optimizer, device)
        deepspeed = bool(cfg.train.deepspeed)
        policy = load_policy(cfg.model, device, master_weights=uses_autocast(cfg.model, deepspeed))
        compute = compute_context(cfg.model, device, deepspeed)  # bf16 autocast over fp32 master weights
        trainable = build_trainable(cfg, policy, info)
        out = claim_output_dir(cfg, info.is_main)  # setup succeeded: only now is anything written
        barrier(info)
        start_step, trained, dropped_ids = 0, {}, {}
        resumed = resume_checkpoint(out, trainable, info) if cfg.train.resume else None
        if resumed is not None:
            checkpoint, state = resumed
            start_step, trained = state["step"], state.get("trained_batch_ids", {})
            dropped_ids = state.get("dropped_batch_ids", {})
            print0(info, f"resumed from {checkpoint} (step {start_step}, {len(trained)} batches trained)")
        store = WeightStore(out)
        version, path = start_step, ""  # version 0: the initial weights (model.name_or_path)
        if start_step > 0:  # samplers must continue from the checkpointed weights, not the base model
            path = publish_weights(store, trainable, version, cfg.decoupled.weights_keep, info)
        if info.is_main:
            receiver = RolloutReceiver(cfg.decoupled.address, token=shared_token(cfg),
                                       max_message_bytes=max_message_bytes(cfg), queue_size=cfg.decoupled.queue_size,
                                       trained_ids=trained, dropped_ids=dropped_ids, policy_version=version)
            if start_step > 0:
                receiver.announce_weights(version, path)
        logger_ = MetricsLogger(out, cfg.log.report_to, config_to_dict(cfg), enabled=info.is_main,
                                resume_step=start_step if resumed is not None else None,
                                wandb_project=cfg.log.wandb_project)
        settings = loss_settings(cfg, logprob_processing(cfg, policy, tokenizer))  # the samplers' controls
        counters = {"dropped": 0}

        # As in the colocated loop: the weights are those of step `done` except while a step's update runs
        # (`updating`), and Ctrl-C waits from the update to the step's checkpoint (DeferredInterrupt).
        done = saved = start_step
        updating = False
        interrupt = DeferredInterrupt()

        def checkpoint_now(at_step: int, just_trained: dict[str, str] | None = None) -> None:
            nonlocal saved
            trained_ids = {**(receiver.trained_ids if receiver else {}), **(just_trained or {})}
            state = {"step": at_step, "trained_batch_ids": trained_ids,
                     "dropped_batch_ids": receiver.dropped_ids if receiver else {}}
            save_run_checkpoint(out, at_step, trainable, tokenizer, state, cfg, info)
            saved = at_step
            if receiver:  # the checkpoint lists every batch trained so far: their acks are now final
                receiver.confirm_durable()

        step, skips = start_step, SkipGuard(cfg.optim.max_skipped_steps, cfg.loss.num_iterations)
        try:
            for step in range(start_step + 1, cfg.train.max_steps + 1):
                started = time.perf_counter()
                incoming, waited = next_fresh_batch(receiver, step, cfg, counters) if info.is_main else (None, 0.0)
                batch, meta = share_batch(incoming, info, device, max_message_bytes(cfg))
                mine = rank_slice(batch, info.rank, info.world_size)
                received = time.perf_counter()
                with interrupt.holding():
                    updating = True
                    ptx_batch = ptx_data.batch(step, info.rank) if ptx_data else None
                    with compute:
                        train_stats = train_on_batch(trainable.learner, mine, settings, info, ptx_batch)
                    trained_at = time.perf_counter()
                    metrics = step_metrics(mine, train_stats, cfg.rollout.num_generations, cfg.data.tag_style,
                                           received, 0.0, trained_at - received, info)
                    if step % cfg.train.sync_steps == 0:
                        version = step
                        path = publish_weights(store, trainable, version, cfg.decoupled.weights_keep, info)
                        if receiver:
                            receiver.announce_weights(version, path)
                    # An acknowledgement is final (durable) only once a checkpoint that lists the batch as
                    # trained is on disk. Until then the sampler gets a provisional ack (its slot is freed)
                    # and keeps the batch: a kill before the next checkpoint makes it resend the batch and
                    # the restarted trainer train it again. No acknowledged batch is lost, whatever save_steps.
                    checkpointed = step % cfg.train.save_steps == 0 or step == cfg.train.max_steps
                    if receiver and not checkpointed:
                        receiver.ack(meta["batch_id"], policy_version=version, durable=False)
                    if receiver:
                        queue = receiver.stats
                        metrics.update({
                            "batch_id": meta["batch_id"], "sampler_id": meta["sampler_id"],
                            "staleness/mean": float((step - 1) - meta["policy_version"]),
                            "queue/depth": float(queue.get("queue_depth", 0)),
                            "rollouts/dropped": float(counters["dropped"]),
                            "time/wait_for_rollout_s": waited, "time/weight_sync_s": time.perf_counter() - trained_at,
                            "time/step_s": time.perf_counter() - started,
                            "sampler/seconds_per_batch": float(meta.get("sampler_seconds", float("nan"))),
                            "sampler/tokens_per_s": float(meta.get("sampler_tokens_per_s", float("nan"))),
                            **{k: float(v) for k, v in meta.items() if k.startswith("rollout/dynamic_")},
                        })
                    logger_.log(step, metrics)
                    if cfg.log.num_samples and step % cfg.log.logging_steps == 0:
                        logger_.log_samples(step, sample_records(mine, cfg.log.num_samples))
                    print0(info, f"step {step}: reward {metrics['reward/mean']:+.3f} loss {metrics['loss']:+.4f} "
                                 f"kl {metrics['kl']:.4f} batch {meta['batch_id']}")
                    updating, done = False, step
                    if checkpointed:
                        checkpoint_now(step, just_trained={meta["batch_id"]: meta["sampler_id"]})
                        if receiver:
                            receiver.ack(meta["batch_id"], policy_version=version)
                skips.record(step, train_stats)
        except KeyboardInterrupt:
            if updating or interrupt.forced:
                print0(info, f"interrupted during the update of step {done + 1}: nothing saved; --resume continues "
                             f"from step {saved}")
            elif done > saved:
                checkpoint_now(done)
            raise
        logger_.close()
        final_weights = zero3_full_state_dict(trainable.learner)
        if info.is_main:
            save_final(out, trainable.policy, tokenizer, state_dict=final_weights)
            plot_run(out)
        barrier(info)
        return 0
    finally:
        if receiver is not None:
            receiver.close(bye_reason="training finished")
        shutdown(info)


def main(cfg: RunConfig) -> int:
    """Entry point of ``grpo trainer`` (one per rank under torchrun)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_trainer(cfg)
