"""Nothing that crosses a process boundary is unpickled, and nothing listens beyond this machine without a token."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.config import ConfigError, load_config

pytestmark = pytest.mark.reliability
SRC = Path(__file__).resolve().parents[2] / "src" / "grpo"

# Calls that unpickle (or evaluate) what they read. torch.distributed's *_object helpers pickle too.
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
UNPICKLING_FUNCTIONS = {"load", "loads", "Unpickler", "open"}
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "recv_object_list", "send_object_list"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain or a name, "" otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _keyword(call: ast.Call, name: str):
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return None


def unsafe_loads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, reason) for every call in ``tree`` that could run code from the bytes it reads."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):  # `from pickle import loads` would hide the calls from the checks below
            module = (node.module or "").split(".")[0]
            names = {alias.name for alias in node.names}
            if (module in UNPICKLING_MODULES and names & UNPICKLING_FUNCTIONS) or (module == "torch" and "load" in names):
                found.append((node.lineno, f"from {node.module} import {', '.join(sorted(names))}"))
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        module, _, function = name.rpartition(".")
        if module.split(".")[-1] in UNPICKLING_MODULES and function in UNPICKLING_FUNCTIONS:
            found.append((node.lineno, f"{name}(): unpickles"))
        elif name in ("torch.load", "torch.serialization.load"):
            weights_only = _keyword(node, "weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append((node.lineno, "torch.load() without weights_only=True"))
        elif function in ("load", "fromfile") and module.split(".")[-1] in ("np", "numpy"):
            allow = _keyword(node, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append((node.lineno, "numpy load with allow_pickle"))
        elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all"):
            loader = _keyword(node, "Loader")
            if name != "yaml.load" or loader is None or "Safe" not in _dotted(loader):
                found.append((node.lineno, f"{name}() can build arbitrary objects; use yaml.safe_load"))
        elif function in OBJECT_COLLECTIVES:
            found.append((node.lineno, f"{name}(): torch.distributed pickles the objects it sends"))
        elif name in ("eval", "exec"):
            found.append((node.lineno, f"{name}()"))
    return found


# torch.distributed's object collectives pickle; none is used (batches between ranks go as wire-format bytes,
# decoupled/trainer.share_batch). A new use must be added here deliberately.
ALLOWED: set[tuple[str, str]] = set()


def test_no_unpickling_anywhere_in_the_package():
    problems = []
    for file in sorted(SRC.rglob("*.py")):
        tree = ast.parse(file.read_text(), filename=str(file))
        for line, reason in unsafe_loads(tree):
            if not any(file.name == name and function in reason for name, function in ALLOWED):
                problems.append(f"{file.relative_to(SRC.parent)}:{line}: {reason}")
    assert not problems, "\n".join(problems)


def test_the_static_check_finds_what_it_looks_for():
    # The scanner itself: each of these must be reported, the safe forms not.
    bad = """
import pickle, torch, yaml, numpy as np
pickle.loads(b"")
torch.load("f")
torch.load("f", weights_only=False)
yaml.load(text)
yaml.unsafe_load(text)
np.load("f", allow_pickle=True)
torch.distributed.all_gather_object(out, obj)
from pickle import loads
"""
    assert len(unsafe_loads(ast.parse(bad))) == 8
    safe = 'torch.load("f", map_location="cpu", weights_only=True)\nyaml.safe_load(t)\nnp.load("f")\n'
    assert unsafe_loads(ast.parse(safe)) == []


# ---------------------------------------------------------------- listening sockets


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.168.1.7:5555"])
def test_decoupled_receiver_refuses_a_non_loopback_address_without_a_token(address):
    from grpo.decoupled.transport import check_bind_address

    with pytest.raises(ValueError, match="set a shared token"):
        check_bind_address(address, "")
    check_bind_address(address, "a-long-shared-token")  # with a token it may listen (the token is then required)


@pytest.mark.parametrize("role", ["trainer", "train"])
def test_trainer_on_a_non_loopback_address_without_a_token_is_refused_before_anything_starts(role, tmp_path, capsys,
                                                                                             monkeypatch):
    def must_not_start(*args, **kwargs):
        raise AssertionError("a role started before the address was checked")

    monkeypatch.setattr("grpo.decoupled.trainer_role.main", must_not_start)
    monkeypatch.setattr("grpo.commands.launch.run_decoupled", must_not_start)
    out = tmp_path / "run"
    args = [role, "train.mode=decoupled", "decoupled.address=tcp://0.0.0.0:5555", f"train.output_dir={out}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "grpo: configuration error: decoupled.address: listening on tcp://0.0.0.0:5555 reaches beyond this " \
           "machine: set a shared token" in err, err
    assert not out.exists()
    monkeypatch.delenv("GRPO_RELIABILITY_UNSET", raising=False)
    assert main([*args, "decoupled.token_env=GRPO_RELIABILITY_UNSET"]) == 2
    assert "GRPO_RELIABILITY_UNSET" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_ref_server_refuses_a_non_loopback_host_without_a_token(host, tmp_path):
    from grpo.decoupled.ref_server import make_server

    # Refused before the model is loaded: the path does not even exist.
    with pytest.raises(ConfigError, match="without authentication"):
        make_server(str(tmp_path / "no-model"), host=host, port=0)


def test_everything_listens_on_loopback_by_default(monkeypatch):
    cfg = load_config()
    assert cfg.decoupled.address.startswith("tcp://127.0.0.1:")
    served = {}
    monkeypatch.setattr("grpo.commands.handlers.run_ref_server", lambda *args, **kwargs: served.update(kwargs))
    assert main(["ref-server"]) == 0
    assert served["host"] == "127.0.0.1"
