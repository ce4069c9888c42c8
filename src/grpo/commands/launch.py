"""``grpo train``: check the recipe, then train colocated in this process or start the decoupled roles.

Its own module, light on imports: the decoupled launcher only checks the recipe and starts the roles, which import
torch, transformers and peft themselves, so it loads none of them before they start (``grpo.cli`` imports this
module for ``train`` alone; the colocated trainer is imported once the mode is known).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

from grpo.commands.run_config import command_line_config
from grpo.config import ConfigError
from grpo.decoupled.launcher import run_decoupled
from grpo.decoupled.listen import check_bind_address, shared_token


def train_command(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.resume:
        overrides.append("train.resume=true")
    if args.overwrite:
        overrides.append("train.overwrite=true")
    cfg = command_line_config(args.config, overrides)
    if cfg.train.mode == "decoupled":
        check_listen_address(cfg)
        # the roles resolve the same command line (no recipe: the same default one), so they run this config
        return run_decoupled(cfg, args.config, overrides)
    # the training stack (seconds of imports), loaded once the run is known to need it in this process
    colocated = importlib.import_module("grpo.training.colocated")
    result = colocated.train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # every launcher sets RANK; the summary is the run's, said once
        _print_summary(result)
    return 0


def check_listen_address(cfg) -> None:
    """Refuse a trainer address beyond this machine without a token before anything starts. The receiver
    refuses it too, but only after the models are loaded and the run folder claimed, with a traceback."""
    token = shared_token(cfg)  # a ConfigError of its own when decoupled.token_env names an unset variable
    try:
        check_bind_address(cfg.decoupled.address, token)
    except ValueError as err:
        raise ConfigError(f"decoupled.address: {err}; see decoupled.token_env") from None


def _print_summary(result) -> None:
    print(f"run folder: {result.output_dir}  (last step {result.last_step})")
    if result.eval_before and result.eval_after:
        b, a = result.eval_before, result.eval_after
        print(f"held-out accuracy: {b['accuracy']:.1%} -> {a['accuracy']:.1%} "
              f"({(a['accuracy'] - b['accuracy']) * 100:+.1f} points); "
              f"format rate {b['format_rate']:.1%} -> {a['format_rate']:.1%}")
    best = result.output_dir / "best" / "best.json"
    if best.is_file():  # train.best_metric
        saved = json.loads(best.read_text(encoding="utf-8"))
        print(f"best model: {best.parent} (step {saved['step']}: {saved['metric']} {saved['value']:.4g})")
    print(f"plots: {result.output_dir / 'plots'}   final model: {result.output_dir / 'final'}")
