"""The ``grpo`` command line: one subcommand per job, each a thin call into its module.

Exit status (``grpo.errors``): 0 on success, 2 on a configuration or input error (message on stderr; a checkpoint
that cannot be loaded counts as input), 1 when training cannot go on (aborted, a peer timed out, the disk failed),
130 on Ctrl-C. On N ranks every rank exits with the status of the first rank that failed
(``grpo.parallel.rank_failure``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from grpo.errors import exit_status
from grpo.version import __version__


def _launcher_arguments(parser: argparse.ArgumentParser) -> None:
    # DeepSpeed's launcher passes --local_rank=N to every rank it starts, right after the module
    # (`python -u -m grpo --local_rank=0 train ...`); torchrun sets LOCAL_RANK instead. Accepted before and
    # after the subcommand: SUPPRESS keeps a subcommand's unset default from hiding the top level's value.
    parser.add_argument("--local_rank", "--local-rank", type=int, dest="local_rank", default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (each sets ``handler``, the name of its function in
    ``grpo.commands.handlers``)."""
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO fine-tuning for causal language models.")
    parser.add_argument("--version", action="version", version=f"grpo {__version__}")
    _launcher_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_config_parser, _add_train_parser, _add_roles_parser, _add_plot_parser, _add_eval_parser,
                _add_chat_parser, _add_export_parser, _add_memory_parser, _add_keys_parser):
        add(sub)
    return parser


DTYPES = ("float32", "bfloat16", "float16")  # --dtype's choices


def _add_config_parser(sub) -> None:
    """``grpo config``: print the resolved config."""
    config = sub.add_parser("config", help="print the resolved config (recipe + overrides + the task's values) as YAML, "
                                           "as grpo train would run it")
    config.add_argument("config", nargs="?", help="YAML recipe (default: configs/demo-cpu.yaml when present, else "
                                                  "built-in defaults)")
    config.add_argument("overrides", nargs="*", help="section.key=value (value parsed as YAML)")
    config.set_defaults(handler="config_command")


def _add_train_parser(sub) -> None:
    """``grpo train``: the colocated run (or the decoupled launcher)."""
    train = sub.add_parser("train", help="train with GRPO (colocated: sampling and learning in this process)")
    train.add_argument("config", nargs="?", help="YAML recipe (default: configs/demo-cpu.yaml when present, else "
                                                 "built-in defaults)")
    train.add_argument("overrides", nargs="*", help="section.key=value (value parsed as YAML)")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    train.add_argument("--overwrite", action="store_true", help="replace a previous run in output_dir")
    _launcher_arguments(train)
    train.set_defaults(handler="train_command")


def _add_roles_parser(sub) -> None:
    """``grpo sampler|trainer|ref-server``: one role of a decoupled run each."""
    for role, text in (("sampler", "decoupled mode: sample rollout batches and send them to the trainer"),
                       ("trainer", "decoupled mode: train on the samplers' batches (one per rank under torchrun)"),
                       ("ref-server", "serve reference log-probs over HTTP (decoupled.ref_server_host)")):
        role_parser = sub.add_parser(role, help=text)
        role_parser.add_argument("config", nargs="?", help="YAML recipe (default: as grpo train's)")
        role_parser.add_argument("overrides", nargs="*", help="section.key=value")
        if role == "ref-server":
            role_parser.add_argument("--host", help="address to bind (decoupled.ref_server_host; a non-loopback "
                                                    "one needs decoupled.token_env)")
        else:
            _launcher_arguments(role_parser)
        role_parser.set_defaults(handler="role_command")


def _add_plot_parser(sub) -> None:
    """``grpo plot``: a run's metrics as PNGs."""
    plot = sub.add_parser("plot", help="write plots/*.png of a run's metrics")
    plot.add_argument("run_dir")
    plot.set_defaults(handler="plot_command")


def _add_eval_parser(sub) -> None:
    """``grpo eval``: accuracy of a model on a data set."""
    ev = sub.add_parser("eval", help="greedy answer accuracy and format rate (mean@k, pass@1..k, maj@k with --samples k)")
    ev.add_argument("model", help="model folder, checkpoint, or run folder (uses final/ or the newest checkpoint)")
    ev.add_argument("--data", action="append", metavar="[NAME=]SOURCE",
                    help="file, folder, hub id or synthetic:seed=S,n=N; repeat as NAME=SOURCE for named sets "
                         "(metrics eval/NAME/...) (default: the run's data.eval)")
    ev.add_argument("--task", help="task that loads and scores the data (gsm8k, arithmetic, kk, pkg.module:name; "
                                   "default: the run's data.task, else by the data source)")
    ev.add_argument("--rewards", nargs="*", metavar="NAME",
                    help="reward functions applied to the greedy completions (eval/reward/NAME; default: the run's "
                         "rewards; --rewards with no name: none)")
    ev.add_argument("--bootstrap", type=int, default=0, help="bootstrap resamples for 95%% intervals (0: none)")
    ev.add_argument("--max-samples-written", type=int, help="sampled completions per example in --save-completions")
    ev.add_argument("--split", help="split of a folder/hub id (default: the run's data.eval_split or test)")
    ev.add_argument("--limit", type=int, help="evaluate only the first N examples")
    ev.add_argument("--samples", type=int, default=1, help="k samples per problem: mean@k, unbiased pass@j for j = 1, 2, 4 .. k, maj@k")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for --samples")
    ev.add_argument("--output", help="write a JSON report here")
    ev.add_argument("--save-completions", help="write per-example records (JSON lines) here (named sets: "
                                               "one file each, STEM-NAME.jsonl)")
    ev.add_argument("--batch-size", type=int, default=32)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--device", default="auto")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--base-model", help="base model of a LoRA checkpoint (default: from adapter_config.json)")
    ev.add_argument("--dtype", choices=DTYPES)
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument("--tools", nargs="*", metavar="MODULE:FN",
                    help="tools the model may call, as in rollout.tools (default: the run's rollout.tools and "
                         "rollout.environment; --tools with no name: none)")
    ev.set_defaults(handler="eval_command")


def _add_chat_parser(sub) -> None:
    """``grpo chat``: talk to a model."""
    chat = sub.add_parser("chat", help="talk to a model with the training system prompt")
    chat.add_argument("model", help="model folder, checkpoint, or run folder")
    chat.add_argument("--prompt", help="answer this once and exit (otherwise interactive)")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    chat.add_argument("--system-prompt", help="override the run's system prompt")
    chat.add_argument("--device", default="auto")
    chat.add_argument("--base-model")
    chat.add_argument("--dtype", choices=DTYPES)
    chat.add_argument("--seed", type=int)
    chat.set_defaults(handler="chat_command")


def _add_export_parser(sub) -> None:
    """``grpo export``: a checkpoint as a plain HF model."""
    export = sub.add_parser("export", help="write a checkpoint as a plain HF model (LoRA merged into its base)")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--dtype", choices=DTYPES)
    export.add_argument("--overwrite", action="store_true")
    export.add_argument("--base-model")
    export.set_defaults(handler="export_command")


def _add_memory_parser(sub) -> None:
    """``grpo memory``: the peak-memory estimate."""
    mem = sub.add_parser("memory", help="estimate peak GPU memory per device (model states, activations, logits, PTX, "
                                        "reference, KV cache) and whether it fits")
    mem.add_argument("config", nargs="?", help="YAML recipe (default: as grpo train's)")
    mem.add_argument("overrides", nargs="*", help="section.key=value (value parsed as YAML)")
    mem.add_argument("--gpus", type=int,
                     help="devices the run is spread over (default: decoupled.trainer_ranks, else 1)")
    mem.add_argument("--gpu-gb", type=float, help="memory of one device in GiB (e.g. 80); enables the fits verdict")
    mem.add_argument("--json", action="store_true", help="print {per_device_gb, total_gb, fits, ...} as JSON")
    mem.add_argument("--mixed-precision", action="store_true", default=None,
                     help="AdamW with fp32 master weights and m, v (the seeds' tables; DeepSpeed bf16 does this)")
    mem.add_argument("--vllm-gpu-memory-utilization", type=float, help="share of --gpu-gb a colocated vLLM reserves")
    mem.set_defaults(handler="memory_command")


def _add_keys_parser(sub) -> None:
    """``grpo keys``: every config key."""
    keys = sub.add_parser("keys", help="list every config key with its type, default and meaning")
    keys.add_argument("--markdown", action="store_true", help="print the markdown table of docs/reference/config.md")
    keys.set_defaults(handler="keys_command")



def _split_config_and_overrides(args: argparse.Namespace) -> None:
    # `grpo config train.max_steps=3` has no file: the first positional is then an override.
    if getattr(args, "config", None) and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides = [args.config, *args.overrides]
        args.config = None


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; ``key=value`` overrides may also follow options (``train x.yaml --overwrite a=1``)."""
    parser = build_parser()
    # argparse stops filling a nargs="*" positional at the first option, so later overrides come back unknown.
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if hasattr(args, "overrides") and "=" in a and not a.startswith("-")]
    if len(late) < len(extra):
        parser.error(f"unrecognized arguments: {' '.join(a for a in extra if a not in late)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (``grpo.errors``: 0 ok, 1 training cannot go on,
    2 configuration/input error, 130 Ctrl-C)."""
    args = parse_arguments(argv)
    _honour_sigint()
    if getattr(args, "local_rank", None) is not None:  # the launcher's own variable wins where it set one
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    _split_config_and_overrides(args)
    try:
        # The handlers import torch, transformers and every role (seconds): loaded only once a command runs, so
        # that `grpo --help` and a mistyped command answer at once (tests/test_layers.py allows these imports).
        # `grpo train`'s are lighter: the decoupled launcher starts its roles without loading what they load.
        if args.handler == "train_command":
            handlers = importlib.import_module("grpo.commands.launch")
        else:
            handlers = importlib.import_module("grpo.commands.handlers")
        return getattr(handlers, args.handler)(args)
    except BaseException as err:
        if isinstance(err, SystemExit):
            raise
        watch = _rank_failure_watch()
        if watch is not None and not isinstance(err, KeyboardInterrupt):
            return watch.fail(err).code  # one of N ranks: the first failure is printed once, by its rank
        known = exit_status(err)
        if known is None:
            raise
        print(known[1], file=sys.stderr)
        return known[0]


def _honour_sigint() -> None:
    """A shell starts a script's background job (`grpo train ... &`) with SIGINT ignored, and Python then installs
    no Ctrl-C handler; a run's step guard installs one anyway, so `kill -INT` stopped it only when it landed inside a
    step (the launcher and a waiting trainer ran on). In grpo SIGINT means "stop and save" at every moment."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _rank_failure_watch():
    """The process group's failure watch (``grpo.parallel.rank_failure``) while this process is one of several
    ranks; looked up, not imported (torch), as a process that never imported it has none."""
    module = sys.modules.get("grpo.parallel.rank_failure")
    return module.current_watch() if module is not None else None


if __name__ == "__main__":
    sys.exit(main())
