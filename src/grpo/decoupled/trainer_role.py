"""The trainer role: gather each step's chunks from the samplers (rank 0), give each rank its own, update,
publish weights.

Rank 0 owns the ZeroMQ receiver, its work plan (which sampler makes which chunk, ``grpo.decoupled.work_plan``)
and the weight store; it hands every step's batch to the other ranks as wire-format bytes over the process
group (never pickle). A chunk is acknowledged after it was trained, provisionally until a checkpoint lists it
(the sampler keeps it until then, to resend after a crash); the trained chunk ids go into every checkpoint,
so a restarted trainer only acknowledges a chunk it trained before. A chunk whose oldest token is more than
``train.max_staleness`` versions behind its step (possible only across a restart) is dropped, counted and made
again. With partial rollouts a chunk names its groups (``grpo.decoupled.carry_over``); a group id is trained at
most once, and the trained ids go into every checkpoint too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from peft import PeftModel

from grpo.config import RunConfig
from grpo.decoupled.carry_over import ALL_GROUPS_TRAINED
from grpo.decoupled.link_settings import (
    ReceivingSettings,
    config_fingerprint,
    max_message_bytes,
    receiving_settings,
    trainer_curve_key,
)
from grpo.decoupled.listen import shared_token
from grpo.decoupled.rendezvous import (
    advertised_address,
    clear_trainer_finished,
    publish_trainer_address,
    publish_trainer_finished,
)
from grpo.decoupled.token_versions import chunk_version, stamped, staleness_metrics
from grpo.decoupled.transport import IncomingBatch, PeerTimeout, RolloutReceiver
from grpo.decoupled.weight_sync import BroadcastPublisher
from grpo.decoupled.wire import batch_to_message, decode, encode, message_to_batch, pack_bytes, unpack_bytes
from grpo.decoupled.work_plan import Chunk, WorkPlan, chunk_of
from grpo.parallel.distributed import DistInfo, barrier, shutdown
from grpo.parallel.fsdp import full_tensor_layout, full_tensors
from grpo.parallel.learners import full_weights
from grpo.run.progress import LineProgress
from grpo.run.run_dir import continues_own_run
from grpo.step.batching import concat_batches, rank_group_spans, rank_groups, select_groups
from grpo.training.inputs import GivenInputs
from grpo.training.loop import Collected, run_loop
from grpo.training.prepare import OpenedRun, build_evaluator, make_loop, prepare, start_process
from grpo.weight_store import WeightStore, state_dict_for_publish
from grpo.weight_store.streamed import TensorStream
from grpo.weight_store.broadcast import WeightBroadcast

# how much longer than the members' join timeout rank 0 waits for the broadcast group before using files
FORM_MARGIN_S = 10.0

logger = logging.getLogger(__name__)


def share_batch(batch, meta: dict | None, info: DistInfo, device: torch.device, max_bytes: int):
    """Rank 0's batch and header on every rank: wire-format bytes broadcast as a uint8 tensor (length first).
    No batch on rank 0 (it was asked to stop while waiting): KeyboardInterrupt on every rank."""
    if not info.enabled:
        return batch, meta
    if info.is_main:
        data = None
        if batch is not None:
            header, tensors = batch_to_message(batch, meta)
            data = torch.frombuffer(bytearray(pack_bytes(encode("batch", header, tensors))), dtype=torch.uint8)
        size = torch.tensor([data.numel() if data is not None else -1], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    size = size.to(comm_device)
    dist.broadcast(size, src=0)
    if int(size.item()) < 0:
        raise KeyboardInterrupt  # every rank stops after the last finished step (grpo.training.loop)
    if not info.is_main:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    data = data.to(comm_device)
    dist.broadcast(data, src=0)
    message = decode(unpack_bytes(data.cpu().numpy().tobytes()), max_bytes=max_bytes)
    return message_to_batch(message)


def publish_weights(store, trainable, version: int, keep: int, info: DistInfo, publisher=None) -> str:
    """Write weights ``version`` (rank 0; gathered from every rank first under ZeRO-3 and FSDP2); returns the path
    to announce. With a ``BroadcastPublisher`` (rank 0, ``decoupled.weight_sync: broadcast``) full weights are
    broadcast to the samplers first (``grpo.decoupled.weight_sync``). FSDP2's full weights go to the file one
    tensor at a time as they are gathered (``publish_streamed``)."""
    if trainable.fsdp and publisher is None and not isinstance(trainable.policy, PeftModel):
        return publish_streamed(store, trainable.policy, version, keep, info)
    gathered = full_weights(trainable.learner)  # a collective under ZeRO-3 and FSDP2
    path = ""
    if info.is_main:
        state, kind, adapter_config = state_dict_for_publish(trainable.policy, gathered)
        # Own copies: DeepSpeed keeps parameters as views of one flat buffer (shared storage).
        state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        if publisher is not None and kind == "full":
            path = publisher.publish(version, state)
        else:
            path = str(store.publish(version, state, kind=kind, adapter_config=adapter_config, keep=keep))
    barrier(info)
    return path


def publish_streamed(store, policy: torch.nn.Module, version: int, keep: int, info: DistInfo) -> str:
    """FSDP2, full weights: each tensor gathered (one all-gather each, every rank) and written by rank 0 into the
    version's file before the next is gathered, so no rank holds the whole model at once. The other ranks run
    the same all-gathers in the same order (as ``full_weights`` does, which rank 0 runs instead under a broadcast
    publisher only it holds)."""
    stream = TensorStream(full_tensor_layout(policy), full_tensors(policy))
    path = ""
    if info.is_main:
        path = str(store.publish(version, stream, kind="full", keep=keep))
    else:
        for _ in stream.tensors:  # rank 0's collectives; nothing is kept here
            pass
    barrier(info)
    return path


def is_fresh(incoming: IncomingBatch, chunk: Chunk, max_staleness: int) -> bool:
    """Whether a chunk for step ``chunk.step`` was made from weights new enough: its oldest token's (the work
    plan asks for new enough weights; older ones come only from before a trainer restart)."""
    return (chunk.step - 1) - chunk_version(incoming) <= max_staleness


def step_chunks(receiver, step: int, settings: ReceivingSettings, held: dict, counts, stop_requested=lambda: False,
                trained_groups=frozenset()) -> tuple[list[IncomingBatch] | None, float]:
    """Step ``step``'s W chunks, in rank order, with the seconds spent waiting. Chunks of later steps that
    arrive meanwhile are kept in ``held``; a stale one is dropped (counted in ``counts.dropped``) and made
    again, as is one whose groups (partial rollouts) are all in ``trained_groups``; the others lose those
    (checked again for a held chunk: groups were trained since it came). Waiting longer than the peer timeout
    for any chunk is an error, not a hang; None when ``stop_requested()`` turns true meanwhile (SIGTERM while
    the samplers are gone must not wait that long)."""
    started = last_arrival = last_status = time.perf_counter()
    wanted = [Chunk(step, rank) for rank in range(settings.trainer_ranks)]
    for chunk in [c for c in wanted if c in held]:
        if (part := untrained_part(held[chunk], trained_groups)) is None:
            receiver.drop(held.pop(chunk).batch_id, ALL_GROUPS_TRAINED, final=False)
        else:
            held[chunk] = part
    while not all(c in held for c in wanted):
        incoming = receiver.next_batch(timeout_s=1.0)
        now = time.perf_counter()
        if incoming is None:
            if stop_requested():
                return None, now - started
            if now - last_arrival > settings.peer_timeout_s:
                missing = [c.id for c in wanted if c not in held]
                raise PeerTimeout(f"no rollout chunk from any sampler for {now - last_arrival:.0f} s "
                                  f"(decoupled.peer_timeout_s); step {step} misses {missing}; "
                                  f"samplers: {list(receiver.peers())}")
            if now - last_status > 30:
                logger.warning("step %d: waiting for rollouts for %.0f s (samplers: %s)", step, now - started,
                               list(receiver.peers()) or "none connected")
                last_status = now
            continue
        last_arrival = now
        chunk = chunk_of(incoming.batch_id)
        if chunk.step < step:  # a copy from before a restart of a step trained since
            receiver.drop(incoming.batch_id, f"step {chunk.step} is trained already", final=False)
        elif not is_fresh(incoming, chunk, settings.max_staleness):
            receiver.drop(incoming.batch_id, f"stale: made with version {chunk_version(incoming)} for step "
                          f"{chunk.step}, max_staleness {settings.max_staleness}", final=False)
            counts.dropped += 1
        elif (fresh := untrained_part(incoming, trained_groups | step_groups(held, chunk.step))) is None:
            receiver.drop(incoming.batch_id, ALL_GROUPS_TRAINED, final=False)
        else:  # a chunk without token versions (none are required on the wire): its header's version made each
            held[chunk] = replace(fresh, batch=stamped(fresh.batch, fresh.policy_version))
    return [held.pop(c) for c in wanted], time.perf_counter() - started


def step_groups(held: dict, step: int) -> set[str]:
    """The partial-rollout groups in the chunks of ``step`` held so far (an orphan adopted while its first sampler
    was only silent may come in two chunks of one step: the second loses it)."""
    return {g for chunk, incoming in held.items() if chunk.step == step for g in incoming.meta.get("groups", ())}


def untrained_part(incoming: IncomingBatch, trained_groups) -> IncomingBatch | None:
    """A partial-rollout chunk (its header lists its ``groups``) without the groups trained already (a group
    made twice, its first copy trained in another chunk, or held in another chunk of the step); None when none
    is left. Other chunks as they are."""
    groups = incoming.meta.get("groups")
    if groups is None:
        return incoming
    kept = [i for i, g in enumerate(groups) if g not in trained_groups]
    if not kept:
        return None
    if len(kept) == len(groups):
        return incoming
    logger.warning("chunk %s: %d of its groups are trained (or held) already; training the other %d",
                   incoming.batch_id, len(groups) - len(kept), len(kept))
    return replace(incoming, batch=select_groups(incoming.batch, kept),
                   meta={**incoming.meta, "groups": [groups[i] for i in kept]})


PER_CHUNK_COUNTS = ("rollout/dynamic_", "rollout/partial_")  # header counts averaged over a step's chunks


def step_meta(chunks: list[IncomingBatch]) -> dict:
    """One header for a step made of chunks: their ids and samplers joined, the oldest weights' version,
    the dynamic-sampling counts averaged over the chunks (as the colocated ranks' are)."""
    metas = [c.meta for c in chunks]
    dynamic = {k for m in metas for k in m if k.startswith(PER_CHUNK_COUNTS)}
    return {"batch_id": ",".join(c.batch_id for c in chunks),
            "sampler_id": ",".join(sorted({c.sampler_id for c in chunks})),
            "samplers": len({c.sampler_id for c in chunks}),
            "policy_version": min(chunk_version(c) for c in chunks),
            "chunk_ids": [c.batch_id for c in chunks], "chunk_samplers": [c.sampler_id for c in chunks],
            "groups": [g for c in chunks for g in c.meta.get("groups", [])],
            "sampler_seconds": sum(float(m.get("sampler_seconds", float("nan"))) for m in metas) / len(metas),
            "sampler_tokens_per_s": sum(float(m.get("sampler_tokens", float("nan"))) for m in metas)
            / max(max(float(m.get("sampler_seconds", float("nan"))) for m in metas), 1e-9),
            **{k: sum(float(m.get(k, 0.0)) for m in metas) / len(metas) for k in dynamic}}


@dataclass
class Receiving:
    """How the trainer role gets a step's batch: rank 0 gathers the step's chunks from the samplers (the work
    plan in its receiver tells them which to make) and every rank takes its own; after the update, weights
    are published and the chunks acknowledged (a ``grpo.training.loop.StepSource``)."""

    settings: ReceivingSettings
    receiver: object | None  # grpo.decoupled.transport.RolloutReceiver on rank 0, None elsewhere
    store: object  # grpo.weight_store.WeightStore
    trainable: object
    info: DistInfo
    device: torch.device
    version: int  # the newest published weights' version
    pad_token_id: int
    publisher: object | None = None  # grpo.decoupled.weight_sync.BroadcastPublisher (rank 0, broadcast)
    dropped: int = 0  # stale chunks dropped so far
    meta: dict = field(default_factory=dict)  # the step in hand's header (chunk ids, samplers, version, timings)
    held: dict = field(default_factory=dict)  # chunks of later steps that arrived early (rank 0)
    trained_groups: set = field(default_factory=set)  # partial rollouts' group ids trained so far (rank 0)

    def collect(self, step: int, stop_requested=lambda: False) -> Collected:
        started = time.perf_counter()
        batch, meta, waited = None, None, 0.0
        if self.info.is_main:
            chunks, waited = step_chunks(self.receiver, step, self.settings, self.held, self, stop_requested,
                                         self.trained_groups)
            if chunks is not None:
                batch = concat_batches([c.batch for c in chunks], self.pad_token_id)
                meta = {**step_meta(chunks), **staleness_metrics(batch, step - 1)}
        batch, self.meta = share_batch(batch, meta, self.info, self.device, self.settings.max_message_bytes)
        mine, share = self.rank_part(batch)
        return Collected(mine, time.perf_counter() - started, metrics={"time/wait_for_rollout_s": waited},
                         rank_share=share)

    def rank_part(self, batch) -> tuple[object, float]:
        """This rank's groups of the step's ``batch`` and its rows over the mean rows per rank. With partial
        rollouts a step's group count varies: ranks get as even a split as whole groups allow (the update
        scales each rank's loss to its share: ``grpo.step.update_inputs.LossSettings.uneven_ranks``)."""
        rank, world = self.info.rank, self.info.world_size
        if not self.settings.partial_rollouts:
            return rank_groups(batch, rank, world), 1.0
        groups = len(batch.prompts)
        mine = rank_group_spans(groups, world)[rank]
        return select_groups(batch, mine), len(mine) * world / groups

    def after_update(self, step: int, collected: Collected, checkpointing: bool) -> dict[str, float]:
        started, meta = time.perf_counter(), self.meta
        if self.receiver:
            self.receiver.step_trained(step)
            self.trained_groups.update(meta["groups"])
        if step % self.settings.sync_steps == 0:
            self.version = step
            path = publish_weights(self.store, self.trainable, self.version, self.settings.weights_keep,
                                   self.info, self.publisher)
            if self.receiver:
                self.receiver.announce_weights(self.version, path)
        if not self.receiver:
            return {}
        # An acknowledgement is final (durable) only once a checkpoint that lists the chunk as trained is on
        # disk. Until then the sampler gets a provisional ack (its slot is freed) and keeps the chunk: a kill
        # before the next checkpoint makes it resend the chunk and the restarted trainer train it again.
        if not checkpointing:
            for chunk_id in meta["chunk_ids"]:
                self.receiver.ack(chunk_id, policy_version=self.version, durable=False)
        return {
            "batch_id": meta["batch_id"], "sampler_id": meta["sampler_id"], "samplers/per_step": float(meta["samplers"]),
            "staleness/mean": float((step - 1) - meta["policy_version"]),
            "staleness/token_mean": float(meta["staleness/token_mean"]),
            "staleness/token_max": float(meta["staleness/token_max"]),
            "queue/depth": float(self.receiver.stats.get("queue_depth", 0)),
            "rollouts/dropped": float(self.dropped), "time/weight_sync_s": time.perf_counter() - started,
            "sampler/seconds_per_chunk": float(meta["sampler_seconds"]),
            "sampler/tokens_per_s": float(meta["sampler_tokens_per_s"]),
            **{k: float(v) for k, v in meta.items() if k.startswith(PER_CHUNK_COUNTS)},
            **({"groups": " ".join(meta["groups"])} if meta["groups"] else {}),  # partial rollouts: which trained
        }

    def checkpoint_state(self, step: int, collected: Collected | None) -> dict:
        if not self.receiver:
            return {"trained_batch_ids": {}, "dropped_batch_ids": {}, "trained_group_ids": [],
                    "carried_groups": {"carried": {}, "orphans": []}}
        just_trained = dict(zip(self.meta["chunk_ids"], self.meta["chunk_samplers"])) if collected is not None else {}
        groups = self.trained_groups | set(self.meta["groups"] if collected is not None else ())
        return {"trained_batch_ids": {**self.receiver.trained_ids, **just_trained},
                "dropped_batch_ids": self.receiver.dropped_ids, "trained_group_ids": sorted(groups),
                "carried_groups": self.receiver.carried_groups}  # who holds which unsent group, across a restart

    def checkpoint_written(self, step: int, collected: Collected | None) -> None:
        if self.receiver:  # the checkpoint lists every chunk trained so far: their acks are now final
            self.receiver.confirm_durable()
            if collected is not None:
                for chunk_id in self.meta["chunk_ids"]:
                    self.receiver.ack(chunk_id, policy_version=self.version)


def start_broadcast(cfg: RunConfig, store) -> BroadcastPublisher | None:
    """Rank 0's side of ``decoupled.weight_sync: broadcast`` (None for files): a TCPStore at
    ``decoupled.weight_sync_port`` that the samplers join, as group ranks 1..num_samplers, within the peer timeout."""
    d = cfg.decoupled
    if d.weight_sync != "broadcast":
        return None
    token = shared_token(cfg)  # without one the store listens on loopback only (grpo.weight_store.broadcast)
    return BroadcastPublisher(store, d.weights_keep, lambda: WeightBroadcast(
        "127.0.0.1", d.weight_sync_port, 0, d.num_samplers + 1, join_timeout_s=d.peer_timeout_s,
        op_timeout_s=d.peer_timeout_s, token=token),  # rank 0 is its own store's client, over loopback
        form_timeout_s=d.peer_timeout_s + FORM_MARGIN_S)


def run_trainer(cfg: RunConfig) -> int:
    """Train ``train.max_steps`` steps on batches from the samplers; returns the exit status."""
    info, device = start_process(cfg)
    receiver = publisher = failed = None
    try:
        if info.world_size != cfg.decoupled.trainer_ranks:
            raise ValueError(f"decoupled.trainer_ranks is {cfg.decoupled.trainer_ranks} but {info.world_size} "
                             "ranks were launched; samplers cut batches by trainer_ranks")
        if info.is_main:
            advertised_address(cfg.decoupled.address, cfg.decoupled.advertise_host)  # a bad one fails before a write
            if cfg.train.overwrite or continues_own_run(cfg):  # the old run's finished mark is not this run's
                clear_trainer_finished(cfg.train.output_dir)
        p = prepare(cfg, GivenInputs(), info, device, samples=False)
        run, trainable = p.run, p.trainable
        store = WeightStore(run.out)
        version, path = run.start_step, ""  # version 0: the initial weights (model.name_or_path)
        if run.start_step > 0:  # samplers must continue from the checkpointed weights, not the base model
            path = publish_weights(store, trainable, version, cfg.decoupled.weights_keep, info)
        if info.is_main:
            receiver = open_receiver(cfg, run, version)
            publish_trainer_address(run.out, advertised_address(receiver.address, cfg.decoupled.advertise_host),
                                    receiver.trainer_id)
            if run.start_step > 0:
                receiver.announce_weights(version, path)
            publisher = start_broadcast(cfg, store)
        receiving = Receiving(receiving_settings(cfg), receiver, store, trainable, info, device, version,
                              p.inputs.tokenizer.pad_token_id, publisher=publisher,
                              trained_groups=set((run.resumed_state or {}).get("trained_group_ids", [])))
        # The samplers run on other weights: the ranks evaluate the newest ones themselves, each a slice.
        evaluate = build_evaluator(cfg, p.inputs, p.policy, info, run.out)
        loop = make_loop(cfg, p, LineProgress(enabled=info.is_main), evaluate)
        result = run_loop(loop, receiving, run.start_step, run.eval_before)
        if info.is_main and result.last_step >= loop.schedule.max_steps:  # a sampler started now exits at once
            publish_trainer_finished(run.out, result.last_step, config_fingerprint(cfg))
        return 0
    except BaseException as err:
        failed = err
        raise
    finally:
        try:
            if publisher is not None:
                publisher.close()
        finally:
            if receiver is not None:
                receiver.close(bye_reason="training finished" if failed is None else "the trainer failed")
        shutdown(info, failed)


def open_receiver(cfg: RunConfig, run: OpenedRun, version: int) -> RolloutReceiver:
    """Rank 0's receiver, bound, its work plan continuing after the run's checkpointed steps (``version``: the
    newest weights)."""
    state = run.resumed_state or {}
    # The queue holds chunks: every rank's of max_staleness + 1 steps may wait in it.
    queue_size = cfg.decoupled.trainer_ranks * max(cfg.decoupled.queue_size, cfg.train.max_staleness + 1)
    return RolloutReceiver(cfg.decoupled.address, token=shared_token(cfg),
                           max_message_bytes=max_message_bytes(cfg), queue_size=queue_size,
                           trained_ids=state.get("trained_batch_ids", {}),
                           dropped_ids=state.get("dropped_batch_ids", {}), policy_version=version,
                           config_hash=config_fingerprint(cfg), curve_secret_key=trainer_curve_key(cfg),
                           work_plan=WorkPlan(cfg.decoupled.trainer_ranks, cfg.train.max_staleness,
                                              trained_steps=run.start_step, version=version),
                           carried_groups=state.get("carried_groups"))


def main(cfg: RunConfig) -> int:
    """Entry point of ``grpo trainer`` (one per rank under torchrun)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_trainer(cfg)
