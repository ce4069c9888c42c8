"""What each ``grpo`` subcommand does once its arguments are parsed (``grpo.cli`` parses them).

A handler is ``<command>_command(args) -> exit status``; ``grpo.cli`` looks it up by name when the command runs, so that
``grpo --help`` and a mistyped command answer without loading torch, transformers and every role. ``grpo train`` is
``grpo.commands.launch``'s.
"""

from __future__ import annotations

import argparse
import sys

from grpo.commands.chat import run_chat
from grpo.commands.eval_command import run_eval_command
from grpo.commands.export import export_model
from grpo.commands.memory import run_memory_command
from grpo.commands.launch import check_listen_address
from grpo.commands.run_config import command_line_config
from grpo.config import iter_config_keys, run_config_text
from grpo.config.docs import config_keys_markdown
from grpo.decoupled.ref_server import run_ref_server
from grpo.decoupled.sampler_role import main as run_sampler_role
from grpo.decoupled.trainer_role import main as run_trainer_role
from grpo.run.plots import plot_run
from grpo.training.settings import logprob_pass


def config_command(args: argparse.Namespace) -> int:
    sys.stdout.write(run_config_text(command_line_config(args.config, args.overrides)))
    return 0


def role_command(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if getattr(args, "host", None):
        overrides.append(f"decoupled.ref_server_host={args.host}")
    cfg = command_line_config(args.config, overrides, say_notes=False)
    if args.command == "trainer":
        check_listen_address(cfg)
    if args.command == "sampler":
        return run_sampler_role(cfg)
    if args.command == "trainer":
        return run_trainer_role(cfg)
    return _ref_server(cfg)


def _ref_server(cfg) -> int:
    run_ref_server(cfg.model.ref_name_or_path or cfg.model.name_or_path, host=cfg.decoupled.ref_server_host,
                   port=cfg.decoupled.ref_server_port, temperature=cfg.rollout.temperature,
                   token_env=cfg.decoupled.token_env, device=cfg.decoupled.ref_server_device,
                   dtype=cfg.model.ref_torch_dtype, micro_batch_size=cfg.train.micro_batch_size, logprob_pass=logprob_pass(cfg))
    return 0


def plot_command(args: argparse.Namespace) -> int:
    for path in plot_run(args.run_dir):
        print(path)
    return 0


def eval_command(args: argparse.Namespace) -> int:
    run_eval_command(args.model, data=args.data, split=args.split, limit=args.limit, samples=args.samples,
                     temperature=args.temperature, output=args.output, batch_size=args.batch_size,
                     max_new_tokens=args.max_new_tokens, device=args.device, seed=args.seed,
                     base_model=args.base_model, dtype=args.dtype, records_output=args.save_completions,
                     progress=not args.no_progress, tools=args.tools, task=args.task, rewards=args.rewards,
                     bootstrap=args.bootstrap, max_samples_written=args.max_samples_written)
    return 0


def chat_command(args: argparse.Namespace) -> int:
    run_chat(args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
             device=args.device, system_prompt=args.system_prompt, base_model=args.base_model, dtype=args.dtype,
             seed=args.seed)
    return 0


def export_command(args: argparse.Namespace) -> int:
    print(export_model(args.checkpoint, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                       base_model=args.base_model))
    return 0


def memory_command(args: argparse.Namespace) -> int:
    return run_memory_command(args.config, args.overrides, gpus=args.gpus, gpu_gb=args.gpu_gb,
                              json_output=args.json, mixed_precision=args.mixed_precision,
                              vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization)


def keys_command(args: argparse.Namespace) -> int:
    if args.markdown:
        print(config_keys_markdown())
        return 0
    for key, type_name, default, help_text in iter_config_keys():
        print(f"{key:36} {type_name:22} default={default!r}\n    {help_text}")
    return 0
