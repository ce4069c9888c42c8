"""What the documentation pages promise that can be checked mechanically: the generated tables are current, the
reward example runs as shown, the layout names every module, every ``grpo.x.y`` a page names exists, and the exit
status table is the code's own."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PACKAGE = REPO / "src" / "grpo"


def _generated_pages():
    spec = importlib.util.spec_from_file_location("docs_pages", REPO / "scripts" / "docs_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generated_pages()


def test_the_generated_tables_are_current():
    """docs/reference/config.md (from the config tree), cli.md (from the argparse parsers) and the architecture
    matrix of docs/guides/models.md (from the table tests/integration/test_architectures.py checks)."""
    pages = _generated_pages()
    assert {path.name for path in pages} == {"config.md", "cli.md", "models.md"}
    for path, text in pages.items():
        assert path.read_text() == text, f"{path.name} is out of date: run python scripts/docs_pages.py"


def test_the_cli_page_names_every_command_and_option():
    from grpo.cli import build_parser

    page = (DOCS / "reference" / "cli.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        assert f"## `grpo {name}`" in page
        for action in command._actions:
            for flag in action.option_strings:
                if action.help != "==SUPPRESS==" and flag not in ("-h", "--help"):
                    assert flag in page, (name, flag)


def test_the_reward_example_runs_as_documented(tmp_path, monkeypatch):
    """The rewards page's example (a Python file and a recipe's rewards) builds through the real config loader and
    scores a batch the way the trainer calls it."""
    pytest.importorskip("trl.rewards")
    from grpo.config import load_config
    from grpo.rewards import build_reward_functions, score
    from grpo.rewards.context import RewardContext, make_trainer_state

    text = (DOCS / "guides" / "rewards.md").read_text()
    example = text[text.index("<!-- reward-example:begin -->"):text.index("<!-- reward-example:end -->")]
    python = example.split("```python\n")[1].split("```")[0]
    yaml_text = example.split("```yaml\n")[1].split("```")[0]
    (tmp_path / "my_rewards.py").write_text(python)
    (tmp_path / "recipe.yaml").write_text(yaml_text)
    monkeypatch.syspath_prepend(str(tmp_path))

    cfg = load_config(tmp_path / "recipe.yaml")
    columns = {"answer": ["4", "4"], "question": ["2+2?", "2+2?"]}
    fns = build_reward_functions(cfg.rewards, "think", column_names=list(columns))
    context = RewardContext(make_trainer_state(global_step=128, max_steps=256))
    completions = [[{"role": "assistant", "content": "<think>2+2</think><answer>4</answer>"}],
                   [{"role": "assistant", "content": "five"}]]
    scores = score(fns, [r.weight for r in cfg.rewards], [[{"role": "user", "content": "2+2?"}]] * 2, completions,
                   columns, [[1] * 20, [2] * 250], context)
    assert scores.names == ["answer_correct", "brevity", "keyword_bonus", "accuracy_reward",
                            "soft_overlong_punishment_reward"]
    assert not scores.per_function.isnan().any()
    # brevity: -(128/256) x tokens / 256; the bonus for "</answer>"; overlong: 250 > 256 - 32 -> (224 - 250) / 32
    approx = pytest.approx  # float32 columns
    assert scores.per_function[:, 1].tolist() == approx([-0.5 * 20 / 256, -0.5 * 250 / 256], rel=1e-6)
    assert scores.per_function[:, 2].tolist() == approx([0.1, 0.0], rel=1e-6)
    assert scores.per_function[:, 4].tolist() == approx([0.0, (224 - 250) / 32], rel=1e-6)
    assert context.metric_means() == {"brevity/mean_tokens": 135.0}


def test_the_layout_page_names_every_module():
    layout = (DOCS / "development" / "layout.md").read_text()
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    assert modules
    missing = [m for m in modules if not re.search(rf"(?<![\w/.]){re.escape(m)}(?!\w)", layout)]
    assert not missing, f"modules missing from docs/development/layout.md: {missing}"


def _unresolved(names: set[str]) -> list[str]:
    unresolved = []
    for name in sorted(names):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest prefix that is a module
            try:
                if importlib.util.find_spec(".".join(parts[:i])) is not None:
                    break
            except (ImportError, AttributeError, ValueError):  # a prefix that is not a package
                continue
        obj = importlib.import_module(".".join(parts[:i]))
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                unresolved.append(name)
                break
            obj = getattr(obj, attribute)
    return unresolved


def test_every_grpo_name_the_docs_give_exists():
    """Every dotted ``grpo.x.y`` of the README and the pages is a module that exists (or an attribute of one).
    history.md is left out: it tells of modules as they were."""
    pages = [REPO / "README.md",
             *(p for p in DOCS.rglob("*.md") if "_incoming" not in p.parts and p.name != "history.md")]
    names = {name for page in pages for name in re.findall(r"(?<![\w./-])grpo(?:\.[A-Za-z_]\w*)+", page.read_text())}
    assert len(names) > 50
    unresolved = _unresolved(names)
    assert not unresolved, f"the docs name modules or attributes that do not exist: {unresolved}"


def test_the_exit_status_table_is_the_codes_own():
    """Every status the table lists is one grpo.errors defines, and every one it defines is listed."""
    from grpo import errors

    text = (DOCS / "reference" / "exit-codes.md").read_text()
    table = text[text.index("| status |"):]
    table = table[:table.index("\n\n")]
    listed = {int(code) for code in re.findall(r"^\| `(\d+)` \|", table, flags=re.MULTILINE)}
    defined = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert listed == defined == {0, 1, 2, 130}
    for name, value in vars(errors).items():  # what the table says of each is what the code does
        if name == "EXIT_BAD_INPUT":
            assert f"| `{value}` | a configuration or input error" in table
        if name == "EXIT_INTERRUPTED":
            assert f"| `{value}` | Ctrl-C or SIGTERM" in table


def test_every_status_the_command_line_returns_is_in_the_table():
    """grpo.errors.exit_status maps each known error to a listed status (the command line returns nothing else
    but 0 and 130, both listed)."""
    from grpo.config import ConfigError
    from grpo.data import DataError
    from grpo.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, RewardError, TrainingAborted, exit_status

    cases = {ConfigError("k"): EXIT_BAD_INPUT, DataError("f:1"): EXIT_BAD_INPUT, RewardError("r"): EXIT_BAD_INPUT,
             TrainingAborted("nan"): EXIT_FAILED, TimeoutError("peer"): EXIT_FAILED,
             OSError(28, "No space left on device"): EXIT_FAILED, KeyboardInterrupt(): EXIT_INTERRUPTED}
    for err, status in cases.items():
        assert exit_status(err)[0] == status, err
    assert exit_status(ZeroDivisionError()) is None  # a bug: its traceback, status 1
