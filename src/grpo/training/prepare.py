"""Setup shared by the roles that train or sample (colocated loop, decoupled trainer and sampler): the
process and its device, data, rewards, PTX pairs, the learner, and the run folder (claim, resume, logger)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.config import RunConfig, config_to_dict
from grpo.config.rules import ptx_max_length
from grpo.tasks import run_system_prompt, run_task
from grpo.models.loading import resolve_device
from grpo.run.checkpoint import CheckpointLayout, checkpoint_layout
from grpo.training.resume import resume_checkpoint
from grpo.run.run_dir import claim_output_dir
from grpo.run.tracking import MetricsLogger
from grpo.parallel.distributed import DistInfo, all_gather_json, barrier, init_distributed, print0
from grpo.parallel.trainable import Trainable, build_trainable
from grpo.config import ConfigError
from grpo.data import load_sft_pairs
from grpo.data.sft_tokens import tokenize_pairs
from grpo.rewards import build_reward_functions
from grpo.step.ptx import PtxData
from grpo.training.evaluator import eval_sources
import secrets
import socket


def start_process(cfg: RunConfig) -> tuple[DistInfo, torch.device]:
    """Join the process group (if launched with N ranks) and pick this rank's device."""
    device = resolve_device(cfg.train.device)
    # Collectives must outwait the longest wait a rank can make: rank 0 waiting decoupled.peer_timeout_s for a
    # batch while the others wait in a broadcast (NCCL's default 10 min is no longer than that wait's 600 s,
    # so the other ranks crashed first instead of rank 0's clean timeout), or an evaluation on rank 0.
    info = init_distributed(device.type, timeout_s=max(1800.0, 2 * cfg.decoupled.peer_timeout_s))
    if device.type == "cuda" and info.enabled:
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    return info, device


def load_data(cfg: RunConfig) -> tuple[list, dict[str, list]]:
    """(training examples, held-out sets ``{name: examples}``: {} without data.eval, the one unnamed set ""
    for a plain source), read by the run's task (``data.task``)."""
    task = run_task(cfg)
    train_set = task.load(cfg.data.train, cfg.data.split, cfg.data.train_limit)
    eval_sets = {name: task.load(source, cfg.data.eval_split, cfg.data.eval_limit)
                 for name, source in eval_sources(cfg.data.eval).items()}
    return train_set, eval_sets


def build_rewards(cfg: RunConfig, examples: Sequence | None = None) -> tuple[list, list[float]]:
    """The configured reward functions and their weights; a reward that cannot be built (unknown
    name, a dotted path that does not import, bad params or factory_args) or, given the training
    ``examples``, cannot take TRL's keyword call with their columns is a configuration error naming it."""
    column_names = list(examples[0].columns()) if examples else None
    if not cfg.rewards:  # allowed by the rules only with rollout.environment: its get_reward (multiturn.setup)
        return [], []
    try:
        functions = build_reward_functions(cfg.rewards, cfg.data.tag_style, column_names)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"rewards: {err}") from None
    except SyntaxError as err:
        # A user's reward module with a syntax error is not an ImportError: without this it left the
        # command with a traceback (exit 1) instead of a configuration error naming the reward.
        names = ", ".join(repr(r.name) for r in cfg.rewards if ":" in r.name)
        raise ConfigError(f"rewards: reward {names} does not import: {err.filename}:{err.lineno}: "
                          f"SyntaxError: {err.msg}") from None
    return functions, [r.weight for r in cfg.rewards]


def load_ptx_data(cfg: RunConfig, tokenizer, info: DistInfo):
    """The PTX pairs tokenized (a ``grpo.step.ptx.PtxData``), or None when ``ptx.data`` is null. Every rank
    reads the whole file (the order picks its rows); how many pairs were cut or left out to fit ptx.max_length
    is printed once."""
    if cfg.ptx.data is None:
        return None

    p = cfg.ptx
    pairs = load_sft_pairs(p.data, p.prompt_column, p.response_column, p.response_format, cfg.data.tag_style,
                           p.split)
    max_length = ptx_max_length(cfg)
    tokenized = tokenize_pairs(tokenizer, pairs, run_system_prompt(cfg), max_length)
    print0(info, f"ptx: {len(tokenized.rows)} of {len(pairs)} pairs from {p.data}; ptx.max_length {max_length}: "
                 f"{tokenized.cut} responses cut short, {tokenized.dropped} pairs left out (prompt too long)")
    return PtxData(tokenized.rows, micro_batch_size=p.micro_batch_size, world_size=info.world_size,
                   seed=cfg.train.seed, pad_id=tokenizer.pad_token_id)


@dataclass
class OpenedRun:
    """The claimed run folder, where the run starts (after a resume) and its metrics logger."""

    out: Path
    start_step: int
    resumed_state: dict | None  # the checkpoint's trainer state, None for a new run
    logger: MetricsLogger
    layout: CheckpointLayout  # where its checkpoints go (train.checkpoint_layout)


def check_shared_run_folder(out: Path, info: DistInfo) -> None:
    """Every rank must see the run folder rank 0 claimed: checkpoints, resume and metrics live there, and a
    node with its own copy would resume at another step (a hang or a silent divergence). Rank 0 writes a
    random token there, every rank reads it back; a ConfigError on every rank names the hosts that cannot."""
    if not info.enabled:
        return

    marker = out / ".grpo-shared-check"
    if info.is_main:
        marker.write_text(secrets.token_hex(16))
    token = all_gather_json(marker.read_text() if info.is_main else None, info)[0]  # after rank 0 wrote it
    try:
        seen = marker.read_text() == token
    except OSError:
        seen = False
    ranks = all_gather_json({"rank": info.rank, "host": socket.gethostname(), "seen": seen}, info)
    if info.is_main:
        marker.unlink(missing_ok=True)
    blind = [r for r in ranks if not r["seen"]]
    if blind:
        who = ", ".join(f"rank {r['rank']} on {r['host']}" for r in blind)
        raise ConfigError(f"train.output_dir: {out} is not one folder for every rank: {who} cannot see the files "
                          f"rank 0 ({ranks[0]['host']}) writes there; put the run folder on a filesystem every node "
                          "mounts at the same path (NFS, Lustre, ...)")


def open_run(cfg: RunConfig, trainable: Trainable, info: DistInfo, critic=None) -> OpenedRun:
    """Claim the run folder (setup succeeded: only now is anything written), resume from its newest
    checkpoint that loads when ``train.resume`` (``train.resume_from``: that one), and open the metrics logger."""
    layout = run_layout(cfg)
    out = claim_output_dir(cfg, info.is_main, layout)
    barrier(info)
    check_shared_run_folder(out, info)
    resuming = cfg.train.resume or cfg.train.resume_from is not None
    only = Path(cfg.train.resume_from) if cfg.train.resume_from is not None else None
    resumed = resume_checkpoint(out, trainable, info, critic, layout, only) if resuming else None
    start_step, state = 0, None
    if resumed is not None:
        checkpoint, state = resumed
        start_step = state["step"]
        print0(info, f"resumed from {checkpoint} (step {start_step})")
    # A resume that found no checkpoint starts over, and so do its metrics (resume_step 0 would keep the
    # killed run's step-0 evaluation and log it a second time).
    logger = MetricsLogger(out, cfg.log.report_to, config_to_dict(cfg), enabled=info.is_main,
                           resume_step=start_step if resumed is not None else None,
                           wandb_project=cfg.log.wandb_project)
    return OpenedRun(out, start_step, state, logger, layout)


def run_layout(cfg: RunConfig) -> CheckpointLayout:
    return checkpoint_layout(cfg.train.checkpoint_layout, cfg.loss.num_iterations)
