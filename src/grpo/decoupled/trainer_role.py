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
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo.config import RunConfig
from grpo.decoupled.link_settings import config_fingerprint, max_message_bytes, shared_token, trainer_curve_key
from grpo.decoupled.transport import IncomingBatch, PeerTimeout
from grpo.decoupled.wire import batch_to_message, decode, encode, message_to_batch, pack_bytes, unpack_bytes
from grpo.models.loading import check_memory_savers, compute_context, load_policy, load_tokenizer, uses_autocast
from grpo.run.progress import LineProgress
from grpo.run.run_dir import check_output_dir
from grpo.step.batching import rank_slice
from grpo.training.distributed import DistInfo, barrier, shutdown
from grpo.training.loop import Collected, Loop, PolicyUpdate, run_loop
from grpo.training.settings import logprob_processing, loop_schedule, loss_settings
from grpo.training.setup import build_trainable, load_ptx_data, open_run, start_process

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


def next_fresh_batch(receiver, step: int, cfg: RunConfig, counts) -> tuple[IncomingBatch, float]:
    """The next batch at most ``max_staleness`` versions old (older ones are dropped and counted in
    ``counts.dropped``), with the seconds spent waiting. Waiting longer than the peer timeout is an error,
    not a hang."""
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
            counts.dropped += 1
            continue
        return incoming, now - started


@dataclass
class Receiving:
    """How the trainer role gets a step's batch: rank 0 takes the next fresh one from the samplers and every
    rank its slice; after the update, weights are published and the batch acknowledged (a
    ``grpo.training.loop.StepSource``)."""

    cfg: RunConfig
    receiver: object | None  # grpo.decoupled.transport.RolloutReceiver on rank 0, None elsewhere
    store: object  # grpo.weight_store.WeightStore
    trainable: object
    info: DistInfo
    device: torch.device
    version: int  # the newest published weights' version
    dropped: int = 0  # stale batches dropped so far
    meta: dict = field(default_factory=dict)  # the batch in hand's header (id, sampler, version, timings)

    def collect(self, step: int) -> Collected:
        started = time.perf_counter()
        incoming, waited = next_fresh_batch(self.receiver, step, self.cfg, self) if self.info.is_main else (None, 0.0)
        batch, self.meta = share_batch(incoming, self.info, self.device, max_message_bytes(self.cfg))
        mine = rank_slice(batch, self.info.rank, self.info.world_size)
        return Collected(mine, time.perf_counter() - started, metrics={"time/wait_for_rollout_s": waited})

    def after_update(self, step: int, collected: Collected, checkpointing: bool) -> dict[str, float]:
        started, meta = time.perf_counter(), self.meta
        if step % self.cfg.train.sync_steps == 0:
            self.version = step
            path = publish_weights(self.store, self.trainable, self.version, self.cfg.decoupled.weights_keep, self.info)
            if self.receiver:
                self.receiver.announce_weights(self.version, path)
        if not self.receiver:
            return {}
        # An acknowledgement is final (durable) only once a checkpoint that lists the batch as trained is on
        # disk. Until then the sampler gets a provisional ack (its slot is freed) and keeps the batch: a kill
        # before the next checkpoint makes it resend the batch and the restarted trainer train it again.
        if not checkpointing:
            self.receiver.ack(meta["batch_id"], policy_version=self.version, durable=False)
        return {
            "batch_id": meta["batch_id"], "sampler_id": meta["sampler_id"],
            "staleness/mean": float((step - 1) - meta["policy_version"]),
            "queue/depth": float(self.receiver.stats.get("queue_depth", 0)),
            "rollouts/dropped": float(self.dropped), "time/weight_sync_s": time.perf_counter() - started,
            "sampler/seconds_per_batch": float(meta.get("sampler_seconds", float("nan"))),
            "sampler/tokens_per_s": float(meta.get("sampler_tokens_per_s", float("nan"))),
            **{k: float(v) for k, v in meta.items() if k.startswith("rollout/dynamic_")},
        }

    def checkpoint_state(self, step: int, collected: Collected | None) -> dict:
        if not self.receiver:
            return {"trained_batch_ids": {}, "dropped_batch_ids": {}}
        just_trained = {self.meta["batch_id"]: self.meta["sampler_id"]} if collected is not None else {}
        return {"trained_batch_ids": {**self.receiver.trained_ids, **just_trained},
                "dropped_batch_ids": self.receiver.dropped_ids}

    def checkpoint_written(self, step: int, collected: Collected | None) -> None:
        if self.receiver:  # the checkpoint lists every batch trained so far: their acks are now final
            self.receiver.confirm_durable()
            if collected is not None:
                self.receiver.ack(self.meta["batch_id"], policy_version=self.version)


def run_trainer(cfg: RunConfig) -> int:
    """Train ``train.max_steps`` steps on batches from the samplers; returns the exit status."""
    from grpo.decoupled.transport import RolloutReceiver
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
        run = open_run(cfg, trainable, info)
        state = run.resumed_state or {}
        store = WeightStore(run.out)
        version, path = run.start_step, ""  # version 0: the initial weights (model.name_or_path)
        if run.start_step > 0:  # samplers must continue from the checkpointed weights, not the base model
            path = publish_weights(store, trainable, version, cfg.decoupled.weights_keep, info)
        if info.is_main:
            receiver = RolloutReceiver(cfg.decoupled.address, token=shared_token(cfg),
                                       max_message_bytes=max_message_bytes(cfg), queue_size=cfg.decoupled.queue_size,
                                       trained_ids=state.get("trained_batch_ids", {}),
                                       dropped_ids=state.get("dropped_batch_ids", {}), policy_version=version,
                                       config_hash=config_fingerprint(cfg), curve_secret_key=trainer_curve_key(cfg))
            if run.start_step > 0:
                receiver.announce_weights(version, path)
        receiving = Receiving(cfg, receiver, store, trainable, info, device, version)
        update = PolicyUpdate(trainable, loss_settings(cfg, logprob_processing(cfg, policy, tokenizer)), info,
                              ptx_data)  # the samplers' sampling controls
        loop = Loop(loop_schedule(cfg), update, trainable, tokenizer, run.out, info, run.logger,
                    LineProgress(enabled=info.is_main), compute,
                    cfg.rollout.num_generations, cfg.data.tag_style, cfg.train.save_total_limit)
        run_loop(loop, receiving, run.start_step)
        return 0
    finally:
        if receiver is not None:
            receiver.close(bye_reason="training finished")
        shutdown(info)


def main(cfg: RunConfig) -> int:
    """Entry point of ``grpo trainer`` (one per rank under torchrun)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_trainer(cfg)
