"""The sampler role: ask the trainer for work -> newest weights -> G completions per prompt -> rewards ->
advantages -> old and reference log-probs -> one chunk to the trainer, again and again.

A chunk is trainer rank ``r``'s share of step ``s`` (``grpo.decoupled.work_plan``), made with the prompts and
seeds that rank would sample colocated, so at ``max_staleness = 0`` any number of samplers reproduce
colocated training (dynamic sampling included: a chunk runs the rounds its rank would), and K samplers
share one step's W chunks. The trainer says which chunk to make and from which weights at least; a
restarted sampler simply asks again, and a chunk's id (``step-s/rank-r``) is trained at most once. Every sampled
token carries the version of the weights that drew it (``grpo.decoupled.token_versions``): one per chunk, or,
with ``decoupled.weight_update: in_flight``, newer ones loaded between decode steps (``grpo.rollout.in_flight``).
With ``decoupled.partial_rollouts`` a chunk holds the groups that finished within a token budget, its own prompts'
or carried over from this sampler's earlier chunks (``grpo.decoupled.partial_rollouts``).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import replace

from grpo.config import RunConfig
from grpo.config.loss_rules import records_routing
from grpo.data.prompt_sampler import PromptSampler
from grpo.decoupled.carry_over import ALL_GROUPS_TRAINED, CarryOver
from grpo.decoupled.link_settings import config_fingerprint, max_message_bytes, sampler_curve_key
from grpo.decoupled.listen import shared_token
from grpo.decoupled.partial_rollouts import PartialInputs, partial_experience
from grpo.decoupled.ref_server import RefServerClient
from grpo.decoupled.rendezvous import finished_run, is_wildcard, read_trainer_address, split_tcp
from grpo.decoupled.token_versions import stamped
from grpo.decoupled.transport import PeerClosed, PeerTimeout, RolloutSender
from grpo.decoupled.weight_sync import ReceivedWeights, is_broadcast
from grpo.decoupled.work_plan import Chunk
from grpo.models.architecture import check_architecture
from grpo.models.loading import load_policy, load_reference, resolve_device
from grpo.models.wrappers import eos_token_ids
from grpo.multiturn.driver import sampling_engine
from grpo.multiturn.wiring import with_turns
from grpo.rollout.build import build_engine, holds_own_weights, policy_engine_name
from grpo.rollout.in_flight import InFlight, in_flight_engine
from grpo.rollout.prefix_cache import PrefixCache
from grpo.step.experience import local_reference, rank_experience
from grpo.step.records import RolloutBatch
from grpo.training.inputs import GivenInputs, tokenizer_and_data
from grpo.training.prepare import seed_process
from grpo.training.settings import dynamic_rounds, experience_settings, logprob_pass, logprob_processing
from grpo.weight_store import WeightStore, apply_to_model
from grpo.weight_store.broadcast import WeightBroadcast

logger = logging.getLogger(__name__)
RECONNECT_S = 30.0  # how long a sampler waits for a welcome before it reads the run folder again


class TrainerFinished(Exception):
    """The trainer of this sampler's config already trained its last step (the run folder says so)."""

    def __init__(self, step: int):
        super().__init__(f"the trainer of this config finished at step {step}")
        self.step = step


def check_not_finished(cfg: RunConfig) -> None:
    """TrainerFinished when the run folder says this config's trainer is done: nothing is left to sample. Asked
    only once no trainer answered: a trainer starting over the folder of a finished run of this config
    (``--overwrite``) clears the mark first, but a sampler may read the folder before that."""
    step = finished_run(cfg.train.output_dir, config_fingerprint(cfg))
    if step is not None:
        raise TrainerFinished(step)


def reference_logprobs_fn(cfg: RunConfig, policy, tokenizer, device, token: str, processing=None):
    """Reference log-probs from the configured server, else from a reference loaded here (following the
    sampling controls in ``processing``; the server does not, see grpo.config.rules); None if beta == 0."""
    if cfg.loss.beta == 0:
        return None
    if cfg.decoupled.ref_server_url:
        client = RefServerClient(cfg.decoupled.ref_server_url, token=token or None,
                                 timeout_s=cfg.decoupled.peer_timeout_s, retry_s=cfg.decoupled.ref_server_retry_s)
        client.wait_ready(timeout_s=cfg.decoupled.peer_timeout_s)
        return lambda g: client.logprobs(g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    reference = load_reference(cfg.model, policy, tokenizer, device)
    return local_reference(policy, reference, cfg.rollout.temperature, cfg.train.micro_batch_size, processing,
                           logprob_pass(cfg))


def for_correction(batch: RolloutBatch, correction: bool, in_flight: bool = False) -> RolloutBatch:
    """What the trainer gets of the batch's log-probs.

    Correction off: the old log-probs, taken here at this sampler's (maybe stale) weights, are the ratio's
    denominator; nothing else is sent. On (``loss.sampler_is_correction``): the sampler's own log-probs
    travel as ``sampler_logprobs`` (vLLM's when the engine reports them, else those old log-probs of this
    sampler's weights) and ``old_logprobs`` stay empty, so the trainer takes its own at the weights that
    start the update: the ratio then measures the update alone and the truncated weight the staleness.
    ``in_flight`` (weights loaded mid-generation): the engine's per-token log-probs, each under the weights
    that drew its token, are the sampler's; a pass after generating would see only the last weights.
    """
    if not correction:
        old = batch.sampler_logprobs if in_flight else batch.old_logprobs
        return replace(batch, old_logprobs=old, sampler_logprobs=None)
    sampler = batch.sampler_logprobs if batch.sampler_logprobs is not None else batch.old_logprobs
    return replace(batch, old_logprobs=None, sampler_logprobs=sampler)


def run_sampler(cfg: RunConfig) -> int:
    """Make the chunks the trainer asks for until it says bye (exit 0) or stays silent past the peer timeout."""
    d = cfg.decoupled
    W = d.trainer_ranks
    sampler_id = f"sampler-{d.sampler_index}"
    token = shared_token(cfg)
    try:
        return _sample(cfg, W, sampler_id, token)
    except TrainerFinished as done:
        logger.info("%s: %s (%s); nothing to sample, exiting", sampler_id, done, cfg.train.output_dir)
        return 0


def _sample(cfg: RunConfig, W: int, sampler_id: str, token: str) -> int:
    d = cfg.decoupled
    device = resolve_device(d.sampler_device)
    inputs = tokenizer_and_data(cfg, GivenInputs())  # the trainers' task, data and rewards, as they load them
    tokenizer, train_set = inputs.tokenizer, inputs.train_set
    prompt_sampler = PromptSampler(len(train_set), cfg.train.prompts_per_step, cfg.train.seed, cfg.data.shuffle)
    policy = load_policy(cfg.model, device).eval()
    policy.requires_grad_(False)
    check_architecture(cfg, policy)
    processing = logprob_processing(cfg, policy, tokenizer)  # old and reference log-probs follow the controls
    ref_logprobs = reference_logprobs_fn(cfg, policy, tokenizer, device, token, processing)
    engine = with_turns(build_engine(cfg, policy, tokenizer), inputs.turns, cfg, policy, tokenizer)
    in_flight = d.weight_update == "in_flight"
    correction = cfg.loss.sampler_is_correction
    own_weights = holds_own_weights(sampling_engine(engine))  # vLLM's copy
    settings = experience_settings(cfg, processing, task=inputs.task, decoupled_sampler=True,
                                   engine_holds_weights=own_weights)
    sender, welcome = connect_to_trainer(cfg, sampler_id, token)
    weights = SamplerWeights(WeightStore(cfg.train.output_dir), policy, engine, d.peer_timeout_s,
                             join_broadcast(cfg, sender.address))
    logger.info("%s connected to %s: policy version %s", sampler_id, sender.address, welcome.get("policy_version"))
    if in_flight:  # every decode step's weights: the newest announced, loaded without waiting
        engine = in_flight_engine(engine, InFlight(d.inflight_check_tokens, lambda: weights.newest(sender)), tokenizer,
                                  policy_engine_name(cfg, policy))
    elif d.partial_rollouts:  # the same engine for its per-token records, its weights those of the chunk
        fixed = InFlight(cfg.rollout.max_completion_length, lambda: weights.version)
        engine = in_flight_engine(engine, fixed, tokenizer, policy_engine_name(cfg, policy),
                                  setting="decoupled.partial_rollouts is true")
    carry = (CarryOver(cfg.rollout.num_generations, cfg.rollout.max_completion_length, d.partial_token_budget,
                       cfg.rollout.min_new_tokens) if d.partial_rollouts else None)
    # carried rows' keys/values, from chunk to chunk (vLLM keeps them in its own prefix cache); a routing recording
    # prefills each row whole (the pass it lines up with), so it keeps none
    kept = PrefixCache() if carry is not None and not own_weights and not records_routing(cfg) else None
    partial_inputs = PartialInputs(tokenizer, train_set, prompt_sampler, inputs.reward_fns, inputs.reward_weights,
                                   settings, cfg.train.seed)
    seen = Settlements()
    try:
        while True:
            work = sender.request_work()
            version = weights.at_least(work["min_version"], sender)
            started = time.perf_counter()
            if carry is None:
                chunk, dynamic = rank_experience(
                    engine, policy, ref_logprobs, tokenizer, train_set, prompt_sampler, inputs.reward_fns,
                    inputs.reward_weights, settings, step=work["step"], rank=work["rank"], world_size=W,
                    seed=cfg.train.seed, max_rounds=dynamic_rounds(cfg))
            else:  # finished groups, of this chunk's prompts or carried over (their tokens carry their versions)
                chunk, dynamic = partial_experience(
                    engine, policy, ref_logprobs, carry, partial_inputs, eos_token_ids(policy, tokenizer),
                    chunk=Chunk(work["step"], work["rank"]), world_size=W, min_version=work["min_version"],
                    settled=seen.new(sender), adopt=work["adopt"], kept=kept)
            seconds = time.perf_counter() - started
            chunk = stamped(chunk, version)  # every token was made by weights ``version``
            tokens = float(chunk.generation.sampled_mask.sum())  # generated: environment tokens are not
            sender.send_batch(for_correction(chunk, correction, in_flight or carry is not None), {
                "batch_id": work["batch_id"], "policy_version": version, "step_index": work["step"],
                "rank": work["rank"], "sampler_seconds": seconds, "sampler_tokens": tokens, **dynamic})
    except PeerClosed:
        logger.info("%s: the trainer finished; exiting", sampler_id)
        return 0
    finally:
        sender.close(bye=False)


class Settlements:
    """Reads the trainer's verdicts on this sampler's chunks once each: the chunk ids acknowledged for good (in
    a checkpoint) and those dropped untrained since the last call (``RolloutSender.acked``/``dropped`` grow),
    less those dropped because all their groups were trained from other copies (nothing to make again)."""

    def __init__(self):
        self.acked = self.dropped = 0

    def new(self, sender: RolloutSender) -> tuple[list[str], list[str]]:
        acked, dropped = sender.acked[self.acked:], sender.dropped[self.dropped:]
        self.acked, self.dropped = self.acked + len(acked), self.dropped + len(dropped)
        return acked, [batch_id for batch_id, reason in dropped if reason != ALL_GROUPS_TRAINED]


def connect_to_trainer(cfg: RunConfig, sampler_id: str, token: str) -> tuple[RolloutSender, dict]:
    """A sender welcomed by the trainer, and the welcome. With a wildcard ``decoupled.address`` the trainer's
    address comes from the run folder; when no trainer answers there within a while, the file is read again
    (a trainer restarted on another host rewrites it) until the peer timeout. TrainerFinished when, after a try
    that no trainer answered, the run folder says this config's trainer finished (whatever the address)."""
    d = cfg.decoupled
    find = is_wildcard(d.address)
    deadline = time.monotonic() + d.peer_timeout_s
    while True:
        left = max(1.0, deadline - time.monotonic())
        address = read_trainer_address(cfg.train.output_dir, left) if find else d.address
        # Every chunk the trainer may wait for can be in flight: W ranks' chunks of max_staleness + 1 steps.
        curve_key, curve_key_file = sampler_curve_key(cfg)  # None unless decoupled.encrypt
        sender = RolloutSender(address, sampler_id, token=token, max_message_bytes=max_message_bytes(cfg),
                               max_inflight=d.trainer_ranks * (cfg.train.max_staleness + 1),
                               timeout_s=d.peer_timeout_s, config_hash=config_fingerprint(cfg),
                               curve_server_key=curve_key, curve_key_file=curve_key_file)
        try:
            return sender, sender.connect(incarnation=secrets.randbits(52), timeout_s=min(left, RECONNECT_S))
        except PeerTimeout as err:
            check_not_finished(cfg)
            if time.monotonic() >= deadline:
                raise PeerTimeout(f"{err} (the last of its tries: {d.peer_timeout_s:.0f} s in all, "
                                  "decoupled.peer_timeout_s)") from None
            logger.warning("%s: no trainer answers at %s; %s", sampler_id, address,
                           "reading its address again" if find else "trying again")


def join_broadcast(cfg: RunConfig, trainer_address: str) -> ReceivedWeights | None:
    """This sampler's receiving thread of ``decoupled.weight_sync: broadcast`` (None for files): it joins
    the group at the trainer's host (the one ``trainer_address`` names) as rank sampler_index + 1."""
    d = cfg.decoupled
    if d.weight_sync != "broadcast":
        return None
    host = (split_tcp(trainer_address) or ("127.0.0.1", ""))[0]  # ipc:// is one host
    return ReceivedWeights(lambda: WeightBroadcast(
        host, d.weight_sync_port, d.sampler_index + 1, d.num_samplers + 1, join_timeout_s=d.peer_timeout_s,
        op_timeout_s=d.peer_timeout_s, token=shared_token(cfg)))


class SamplerWeights:
    """The weights a sampler generates with: the newest the trainer announced, received by broadcast or
    loaded from files (checksums verified), into the HF policy (old log-probs come from it) and into an
    engine that holds its own copy."""

    def __init__(self, store: WeightStore, policy, engine, timeout_s: float, received: ReceivedWeights | None = None):
        self.store, self.policy, self.engine, self.timeout_s = store, policy, engine, timeout_s
        self.received = received  # None: files only
        self.version = 0  # the initial weights (model.name_or_path) are version 0

    def at_least(self, min_version: int, sender: RolloutSender) -> int:
        """Load the newest announced weights when newer than the loaded ones (waiting for version
        ``min_version`` if none that new was announced yet); returns the loaded version."""
        announced, path = sender.latest_weights or (0, "")
        if announced < min_version:
            announced, path = sender.wait_for_weights(min_version)
        return self._load(announced, path)

    def newest(self, sender: RolloutSender) -> int:
        """Load the newest announced weights when newer than the loaded ones, without waiting for any (in
        flight: between two decode steps); returns the loaded version."""
        announced, path = sender.latest_weights or (0, "")
        return self._load(announced, path)

    def _load(self, announced: int, path: str) -> int:
        if announced > self.version:
            loaded = None
            if self.received is not None and is_broadcast(path):
                loaded = self.received.newest(announced, timeout_s=self.timeout_s)
            if loaded is None:  # files: checksums verified first; a version pruned meanwhile gives way to the newest
                loaded = self.store.load_newest(announced, timeout_s=self.timeout_s)
            apply_to_model(self.policy, loaded)
            if holds_own_weights(sampling_engine(self.engine)):
                sampling_engine(self.engine).update_weights(loaded)
            self.version = loaded.version
        return self.version


def main(cfg: RunConfig) -> int:
    """Entry point of ``grpo sampler``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    seed_process(cfg.train.seed + cfg.decoupled.sampler_index, cfg.train.full_determinism)
    return run_sampler(cfg)
