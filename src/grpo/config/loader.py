"""Load the config tree from YAML plus ``section.key=value`` overrides, check it, dump it back.

Every error is a ``ConfigError`` naming where the bad value came from (``file:line`` or the override
text), the dotted key, and what is allowed; unknown keys get a "did you mean".
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

from grpo.config.schema import RewardConfig, RunConfig
from grpo.errors import ConfigError
from grpo.tasks import resolve_task

# ---------------------------------------------------------------- YAML with line numbers


def _key_lines(text: str) -> dict[str, int]:
    """Map dotted keys of a YAML mapping (two levels deep) to their 1-based line numbers."""
    root = yaml.compose(text)
    lines: dict[str, int] = {}
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key_node, value_node in root.value:
        lines[key_node.value] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            for sub_key, _ in value_node.value:
                lines[f"{key_node.value}.{sub_key.value}"] = sub_key.start_mark.line + 1
    return lines


def _read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
        lines = _key_lines(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML: {getattr(err, 'problem', err)}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data, lines


# ---------------------------------------------------------------- type checking


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        return f"list of {_type_name(inner)}"
    if typing.get_origin(tp) is dict:
        key_type, value_type = typing.get_args(tp)
        return f"mapping of {_type_name(key_type)} to {_type_name(value_type)}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` as type ``tp`` or raise ``TypeError`` saying what was expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except TypeError:
                continue
        raise TypeError(f"expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif origin is dict:  # typed entries, e.g. data.eval's {name: source}
        key_type, value_type = typing.get_args(tp)
        if isinstance(value, dict) and value:
            return {_coerce(k, key_type, key): _coerce(v, value_type, f"{key}.{k}") for k, v in value.items()}
    elif origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, list):
            return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is RewardConfig:
        return _reward(value, key)
    else:  # pragma: no cover - a schema field of a type this loader does not know
        raise TypeError(f"unsupported field type {tp!r}")
    raise TypeError(f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _reward(value: Any, key: str) -> RewardConfig:
    if isinstance(value, str):  # shorthand: a bare name, weight 1
        value = {"name": value}
    if not isinstance(value, dict):
        raise TypeError(f"expected a mapping {{name, weight, params}} or a name, got {value!r}")
    return _build(RewardConfig, value, key)


def _check_range(value: Any, meta: dict, key: str) -> None:
    if value is None or isinstance(value, (list, dict, bool)):
        return
    if meta.get("choices") is not None and value not in meta["choices"]:
        allowed = ", ".join("null" if c is None else str(c) for c in meta["choices"])
        raise ValueError(f"{value!r} is not allowed; choose one of: {allowed}")
    if meta.get("ge") is not None and value < meta["ge"]:
        raise ValueError(f"{value} is out of range: must be >= {meta['ge']}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise ValueError(f"{value} is out of range: must be > {meta['gt']}")
    if meta.get("le") is not None and value > meta["le"]:
        raise ValueError(f"{value} is out of range: must be <= {meta['le']}")


def _unknown_key(key: str, known: Iterable[str]) -> str:
    known = list(known)
    leaf = key.rsplit(".", 1)[-1]
    prefix = key[: -len(leaf)]
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    hint = f"; did you mean {prefix}{close[0]}?" if close else ""
    return f"unknown key {key}{hint} (known: {', '.join(sorted(known))})"


def _build(cls: type, values: dict, prefix: str, where=lambda key: "") -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking keys, types and ranges."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(f"{where(key)}{_unknown_key(key, fields)}")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where(key)}{key}: expected a mapping of {tp.__name__} keys, got {value!r}")
            kwargs[name] = _build(tp, value, key, where)
            continue
        try:
            kwargs[name] = _coerce(value, tp, key)
            _check_range(kwargs[name], dict(fields[name].metadata), key)
        except ConfigError as err:  # from a nested record (a reward entry), built without a location
            raise ConfigError(f"{where(key)}{err}") from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where(key)}{key}: {err}") from None
    return cls(**kwargs)


# ---------------------------------------------------------------- public API


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is parsed as YAML (numbers, booleans, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {getattr(err, 'problem', err)}") from None
    return key, value


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Build the checked ``RunConfig`` from an optional YAML file and ``section.key=value`` overrides.

    Raises:
        ConfigError: unknown key (with a suggestion), wrong type, out-of-range value, invalid YAML,
            or an invalid combination; the message names the file and line or the override.
    """
    tree: dict = {}
    lines: dict[str, int] = {}
    if path is not None:
        tree, lines = _read_yaml(Path(path))
    origin: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
        origin[key] = f"override {text!r}: "

    def where(key: str) -> str:
        base = key.split("[", 1)[0]
        for set_key in reversed(origin):  # the last override touching this key (or its section) wins
            if set_key == base or set_key.startswith(base + ".") or base.startswith(set_key + "."):
                return origin[set_key]
        for candidate in (base, base.rsplit(".", 1)[0]):
            if candidate in lines:
                return f"{path}:{lines[candidate]}: "
        return f"{path}: " if path is not None else ""

    rewards_given = _rewards_given(tree)
    return _checked(_build(RunConfig, tree, "", where), where, rewards_given)


def config_from_dict(tree: dict, source: str) -> RunConfig:
    """The checked ``RunConfig`` of a nested dict (``config_to_dict``'s shape; missing keys keep their
    defaults); errors name ``source`` and the key, e.g. ``GRPOConfig: loss.beta ...``."""
    def where(key: str) -> str:
        return f"{source}: "

    tree = copy.deepcopy(tree)
    rewards_given = _rewards_given(tree)
    return _checked(_build(RunConfig, tree, "", where), where, rewards_given)


def _rewards_given(tree: dict) -> bool:
    """Whether the recipe (or an override) lists ``rewards``; ``rewards: null`` is taken out of ``tree`` and
    counts as not given, so that an override can hand a recipe's rewards back to its task."""
    if "rewards" in tree and tree["rewards"] is None:
        del tree["rewards"]
    return "rewards" in tree


def _with_task_rewards(config: RunConfig) -> RunConfig:
    """``config`` with its task's default rewards (``grpo.tasks.Task.rewards``: kk_logic for K&K, answer and
    format for the numeric tasks), for a recipe that lists none. A ``data.task`` that does not resolve keeps
    the schema's default; the ``data.task`` rule then reports it."""
    try:
        task = resolve_task(config.data.task, config.data.train)
    except (ValueError, TypeError):
        return config
    return dataclasses.replace(config, rewards=[RewardConfig(name, float(weight)) for name, weight in task.rewards])


def _checked(config: RunConfig, where, rewards_given: bool) -> RunConfig:
    """``config`` (with its task's rewards unless ``rewards_given``: the recipe or overrides set ``rewards``)
    once its cross-field rules hold; else a ConfigError on the first broken one (``where(key)`` says where the
    key was set), listing the others."""
    if not rewards_given:
        config = _with_task_rewards(config)
    problems = config.check()
    if problems:
        key, why = problems[0]
        more = "".join(f"\n  also: {k} {w}" for k, w in problems[1:])
        raise ConfigError(f"{where(key)}{key} {why}{more}")
    return config


def config_to_dict(config: RunConfig) -> dict:
    """The config as plain data (what ``dump_config`` writes)."""
    return dataclasses.asdict(config)


def dump_config(config: RunConfig, path: str | Path | None = None) -> str:
    """The resolved config as YAML (reloadable with ``load_config``); also written to ``path`` if given."""
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False, allow_unicode=True)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def _choices_or_type(choices: tuple | None, tp: Any) -> str:
    """A key's allowed values as the docs show them (read from the registries the schema's choices come from),
    else its type."""
    if choices is None:
        return _type_name(tp)
    return "one of " + ", ".join("null" if c is None else str(c) for c in choices)


def iter_config_keys(cls: type = RunConfig, prefix: str = "") -> Iterable[tuple[str, str, Any, str]]:
    """Yield ``(dotted key, type or allowed values, default, help)`` for every leaf, for docs and ``--help``."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from iter_config_keys(hints[f.name], f"{key}.")
        else:
            default = getattr(defaults, f.name)
            if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
                default = [dataclasses.asdict(r) for r in default]
            yield key, _choices_or_type(f.metadata.get("choices"), hints[f.name]), default, f.metadata.get("help", "")
