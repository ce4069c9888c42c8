"""The package's layers hold: every import of a grpo module (at module level, inside a function, under
TYPE_CHECKING, or by ``importlib.import_module("grpo....")``) goes to the same layer or one below; the modules
import each other without a cycle; and an import inside a function is only of an optional third-party package (an
extra), with its reason on the line.

Read from the source with ``ast``: nothing is imported, so a violation is found before it can hide behind an
import order that happens to work."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LAYOUT_PAGE = Path(__file__).resolve().parents[1] / "docs" / "development" / "layout.md"

# Lowest first: a package may import only itself and the packages before it.
LAYERS = ["version", "errors", "algorithm", "compat", "data", "rewards", "tasks", "config", "models", "parallel", "run",
          "weight_store", "rollout", "multiturn", "evaluation", "step", "critic", "training", "decoupled", "api",
          "commands", "cli", "__main__", "__init__"]

# The grpo modules loaded on first use, by importer: the package's ``grpo.GRPOTrainer`` (PEP 562); the command
# handlers, so that ``grpo --help`` needs no torch; the colocated trainer, which `grpo train` loads only once the
# recipe says colocated (the decoupled launcher starts its roles without transformers and peft).
LAZY_GRPO_IMPORTS = {"grpo": {"grpo.api"}, "grpo.cli": {"grpo.commands.handlers", "grpo.commands.launch"},
                     "grpo.commands.launch": {"grpo.training.colocated"}}
# Third-party imports allowed inside functions: the optional extras (and IPython, present only in a notebook).
OPTIONAL = {"vllm", "deepspeed", "bitsandbytes", "wandb", "IPython", "reasoning_gym", "verifiers"}
# ... and the installed libraries that cost a notebook's first train() tenths of a second of import for a feature it
# may not use (serving an HTTP endpoint, plots, symbolic answers, TensorBoard, hub datasets; `datasets` costs every
# process ~3 s): loaded by the function that needs them.
# tests/api/test_import_cost.py checks that `from grpo import GRPOConfig, GRPOTrainer` loads none of them.
ON_FIRST_USE = {"fastapi", "starlette", "uvicorn", "matplotlib", "math_verify", "torch.utils.tensorboard", "datasets",
                "torch.distributed.checkpoint"}  # DCP: FSDP2 checkpoints only (0.3 s)
# ... and transformers in the rewards that `import grpo.config` loads (a reward's TRL ``trainer_state``, the reward
# model's classes): the decoupled launcher imports only the config, and transformers costs it seconds before the
# roles start (tests/test_cli_launchers.py checks that it loads none).
OUTSIDE_THE_CONFIG_IMPORT = {"transformers.trainer_callback", "transformers.models.auto"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((SRC / "grpo").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _resolve(name: str) -> str | None:
    """The grpo module that ``name`` (a module, or a module's attribute) is loaded from."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The grpo modules an import statement loads: ``from pkg import sub`` loads ``pkg.sub``."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert node.level == 0, "relative imports are not used in grpo"
        names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                 for alias in node.names]
    return [m for m in (_resolve(n) for n in names if n.startswith("grpo")) if m]


class _Imports(ast.NodeVisitor):
    """Every import of a module, with where it sits: ``runtime`` (module level, loaded on import) or not."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.AST, bool, bool]] = []  # (node, in a function, under TYPE_CHECKING)
        self._function = 0
        self._type_checking = 0

    def _nested(self, node, counter: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        self.generic_visit(node)
        setattr(self, counter, getattr(self, counter) - 1)

    def visit_FunctionDef(self, node):
        self._nested(node, "_function")

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        if "TYPE_CHECKING" in ast.unparse(node.test):
            self._nested(node, "_type_checking")
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        self.found.append((node, self._function > 0, self._type_checking > 0))

    visit_ImportFrom = visit_Import

    def visit_Call(self, node):
        if (ast.unparse(node.func) in ("importlib.import_module", "import_module") and node.args
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("grpo")):
            self.found.append((node, True, False))
        self.generic_visit(node)


def _imports():
    for module, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        visitor = _Imports()
        visitor.visit(ast.parse(text))
        yield module, path, text.splitlines(), visitor.found


def _where(path: Path, node: ast.AST) -> str:
    return f"{'/'.join(path.parts[path.parts.index('grpo'):])}:{node.lineno}"


def test_the_layout_page_declares_these_layers():
    declared = " < ".join(layer for layer in LAYERS if not layer.startswith("__"))
    assert declared in LAYOUT_PAGE.read_text(encoding="utf-8"), f"docs/development/layout.md should name the layers: {declared}"


def test_every_package_has_a_layer():
    packages = {_layer(m) for m in MODULES}
    assert packages <= set(LAYERS), f"packages with no layer in LAYERS: {sorted(packages - set(LAYERS))}"


def test_no_import_goes_up_a_layer():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for module, path, _, found in _imports():
        for node, _, _ in found:
            targets = ([_resolve(node.args[0].value)] if isinstance(node, ast.Call) else _targets(node))
            for target in filter(None, targets):
                if rank[_layer(target)] > rank[_layer(module)]:
                    upward.append(f"{_where(path, node)}: {module} ({_layer(module)}) imports {target} "
                                  f"({_layer(target)})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_imports_inside_functions_are_only_optional_packages_with_a_reason():
    wrong = []
    for module, path, lines, found in _imports():
        for node, in_function, _ in found:
            if not in_function:
                continue
            if isinstance(node, ast.Call):
                if node.args[0].value not in LAZY_GRPO_IMPORTS.get(module, ()):
                    wrong.append(f"{_where(path, node)}: import_module of a grpo module inside a function")
                continue
            name = node.names[0].name if isinstance(node, ast.Import) else node.module
            allowed = OPTIONAL | ON_FIRST_USE | OUTSIDE_THE_CONFIG_IMPORT
            if not any(name == p or name.startswith(p + ".") for p in allowed):
                wrong.append(f"{_where(path, node)}: `{ast.unparse(node)}` inside a function")
                continue
            line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
            if "#" not in line and not above.startswith("#"):
                wrong.append(f"{_where(path, node)}: `{ast.unparse(node)}` needs its reason on the line")
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_modules_import_without_a_cycle():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, _, _, found in _imports():
        graph[module]
        for node, in_function, type_checking in found:
            if not in_function and not type_checking and not isinstance(node, ast.Call):
                graph[module].update(t for t in _targets(node) if t != module)
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


@pytest.mark.parametrize("bad, message", [
    ("import grpo.cli\n", "go up"), ("def f():\n    import grpo.data.planted\n", "inside a function"),
    ("def f():\n    import vllm\n", "needs its reason"),
])
def test_the_checks_catch_what_they_are_for(bad, message, monkeypatch, tmp_path):
    """Each check fails on a planted module (a check that cannot fail would prove nothing)."""
    planted, cli = tmp_path / "grpo" / "data" / "planted.py", tmp_path / "grpo" / "cli.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(bad)
    cli.write_text("")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {"grpo.data.planted": planted, "grpo.cli": cli})
    checks = [test_no_import_goes_up_a_layer, test_imports_inside_functions_are_only_optional_packages_with_a_reason]
    failures = []
    for check in checks:
        try:
            check()
        except AssertionError as error:
            failures.append(str(error))
    assert len(failures) == 1 and message in failures[0], failures


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
