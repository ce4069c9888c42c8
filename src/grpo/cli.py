"""The ``grpo`` command line: one subcommand per job, each a thin call into its module.

Exit status: 0 on success, 2 on a configuration or input error (message on stderr), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys

from grpo import __version__


def _cmd_config(args: argparse.Namespace) -> int:
    from grpo.config import dump_config, load_config

    sys.stdout.write(dump_config(load_config(args.config, args.overrides)))
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from grpo.config import iter_config_keys

    for key, type_name, default, help_text in iter_config_keys():
        print(f"{key:36} {type_name:22} default={default!r}\n    {help_text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO fine-tuning for causal language models.")
    parser.add_argument("--version", action="version", version=f"grpo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="print the resolved config (file + overrides) as YAML")
    config.add_argument("config", nargs="?", help="YAML recipe (default: built-in defaults)")
    config.add_argument("overrides", nargs="*", help="section.key=value (value parsed as YAML)")
    config.set_defaults(func=_cmd_config)

    keys = sub.add_parser("keys", help="list every config key with its type, default and meaning")
    keys.set_defaults(func=_cmd_keys)
    return parser


def _split_config_and_overrides(args: argparse.Namespace) -> None:
    # `grpo config train.max_steps=3` has no file: the first positional is then an override.
    if getattr(args, "config", None) and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides = [args.config, *args.overrides]
        args.config = None


def main(argv: list[str] | None = None) -> int:
    from grpo.config import ConfigError

    args = build_parser().parse_args(argv)
    _split_config_and_overrides(args)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"grpo: configuration error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
