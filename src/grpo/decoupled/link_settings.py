"""Small settings the decoupled roles share: the shared token, the CURVE keys and message limits, and the
trainer's step source's settings record (built here, not in grpo.training.settings: training/ does not
import decoupled/)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from grpo.config import RunConfig, config_to_dict
from grpo.decoupled.transport.curve_keys import PUBLIC_KEY_FILE, read_server_key, server_secret_key


def curve_dir(cfg: RunConfig) -> Path:
    """The folder of the trainer's CURVE key pair (``decoupled.curve_dir``, by default in the run folder)."""
    return Path(cfg.decoupled.curve_dir or Path(cfg.train.output_dir) / "decoupled" / "curve")


def trainer_curve_key(cfg: RunConfig) -> bytes | None:
    """The trainer's CURVE secret key, its pair made on the first start and kept for resumes (a sampler
    holding the public key keeps working); None when ``decoupled.encrypt`` is off."""
    return server_secret_key(curve_dir(cfg)) if cfg.decoupled.encrypt else None


def sampler_curve_key(cfg: RunConfig) -> tuple[bytes | None, str]:
    """The trainer's CURVE public key and the file it came from, waiting up to ``decoupled.peer_timeout_s``
    for the trainer to write it; ``(None, "")`` when ``decoupled.encrypt`` is off."""
    if not cfg.decoupled.encrypt:
        return None, ""
    folder = curve_dir(cfg)
    return read_server_key(folder, cfg.decoupled.peer_timeout_s), str(folder / PUBLIC_KEY_FILE)


# Keys a role may set for itself: which sampler it is, where it runs, how it was started (resume/overwrite
# are the trainer's), device choices that give the same values; everything else must match across roles.
ROLE_LOCAL_KEYS = frozenset({
    "decoupled.sampler_index", "decoupled.sampler_device", "decoupled.ref_server_device", "decoupled.ref_server_url",
    "decoupled.ref_server_host", "decoupled.advertise_host", "train.resume", "train.overwrite", "train.device", "log.progress_bar",
    "model.sdpa_backends", "train.shared_prompt_pass", "train.column_bucket"})


def config_fingerprint(cfg: RunConfig) -> str:
    """A hash of the config every role must share (all keys but ``ROLE_LOCAL_KEYS``): a sampler started
    from another version of the recipe would make batches the trainer must not train on."""
    tree = config_to_dict(cfg)
    for key in ROLE_LOCAL_KEYS:
        section, name = key.split(".")
        tree[section].pop(name, None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()


def max_message_bytes(cfg: RunConfig) -> int:
    return cfg.decoupled.max_message_mb * 1024 * 1024


@dataclass(frozen=True)
class ReceivingSettings:
    """What the trainer role's step source (``grpo.decoupled.trainer_role.Receiving``) reads."""

    trainer_ranks: int  # W: a step is W chunks, one per trainer rank
    max_staleness: int  # train.max_staleness: how many versions a chunk's weights may lag its step
    peer_timeout_s: float  # waiting longer than this for any chunk is an error
    max_message_bytes: int  # the largest batch rank 0 shares with the other ranks
    sync_steps: int  # train.sync_steps: weights are published every N steps
    weights_keep: int  # decoupled.weights_keep: published versions kept on disk
    partial_rollouts: bool = False  # a step holds a varying number of groups, split over the ranks unevenly


def receiving_settings(cfg: RunConfig) -> ReceivingSettings:
    d = cfg.decoupled
    return ReceivingSettings(trainer_ranks=d.trainer_ranks, max_staleness=cfg.train.max_staleness,
                             peer_timeout_s=d.peer_timeout_s, max_message_bytes=max_message_bytes(cfg),
                             sync_steps=cfg.train.sync_steps, weights_keep=d.weights_keep,
                             partial_rollouts=d.partial_rollouts)
