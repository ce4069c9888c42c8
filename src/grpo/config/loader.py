"""Read the config tree from YAML plus ``section.key=value`` overrides into a typed ``RunConfig``, and dump it back.

Every error is a ``ConfigError`` naming where the bad value came from (``file:line`` or the override
text), the dotted key, and what is allowed; unknown keys get a "did you mean". What a run is made of (the
default recipe, the task's values, the cross-field rules) is ``grpo.config.resolve``'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from grpo.config.schema import RewardConfig, RunConfig
from grpo.errors import ConfigError

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
        if value is False and "no" in (fields[name].metadata.get("choices") or ()):
            value = "no"  # YAML 1.1 reads a bare `no` as false: a strategy's "no" written plainly
        try:
            kwargs[name] = _coerce(value, tp, key)
            _check_range(kwargs[name], dict(fields[name].metadata), key)
        except ConfigError as err:  # from a nested record (a reward entry), built without a location
            raise ConfigError(f"{where(key)}{err}") from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where(key)}{key}: {err}") from None
    return cls(**kwargs)


# ---------------------------------------------------------------- recipes and overrides


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree``'s nested key ``a.b.c`` to ``value``, making the mappings on the way."""
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


def read_recipe(path: str | Path) -> tuple[dict, dict[str, int]]:
    """A recipe's tree and the line of each of its keys (two levels deep); a ConfigError naming the file (and
    line) when it is missing, not YAML, or not a mapping of sections."""
    return _read_yaml(Path(path))


def locator(path: str | Path | None, lines: dict[str, int], origin: dict[str, str]) -> Callable[[str], str]:
    """``where(key)``: the prefix of an error about ``key``: the last override that set it (or its section), else
    the recipe's ``file:line``, else the file. ``origin``: override key -> its message prefix."""
    def where(key: str) -> str:
        base = key.split("[", 1)[0]
        for set_key in reversed(origin):  # the last override touching this key (or its section) wins
            if set_key == base or set_key.startswith(base + ".") or base.startswith(set_key + "."):
                return origin[set_key]
        for candidate in (base, base.rsplit(".", 1)[0]):
            if candidate in lines:
                return f"{path}:{lines[candidate]}: "
        return f"{path}: " if path is not None else ""

    return where


def build_config(tree: dict, where: Callable[[str], str] = lambda key: "") -> RunConfig:
    """The ``RunConfig`` of a nested mapping (missing keys keep their defaults), its keys, types and ranges checked
    (a ConfigError prefixed by ``where(key)``); not yet resolved against its task nor checked across fields
    (``grpo.config.resolve`` does both)."""
    return _build(RunConfig, tree, "", where)


def config_to_dict(config: RunConfig) -> dict:
    """The config as plain data (what ``dump_config`` writes)."""
    return dataclasses.asdict(config)


def dump_config(config: RunConfig, path: str | Path | None = None, header: Iterable[str] = ()) -> str:
    """The config as YAML (reloadable with ``load_config``), after ``header``'s lines as comments; also written to
    ``path`` if given."""
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False, allow_unicode=True)
    text = "".join(f"# {line}\n" for line in header) + text
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
