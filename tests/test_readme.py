"""The README's promises that can be checked mechanically."""

from pathlib import Path

from grpo.config.docs import BEGIN, END, config_keys_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "grpo"


def test_config_table_is_generated_from_the_config_tree():
    text = README.read_text()
    section = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert section == config_keys_markdown(), "regenerate with: grpo keys --markdown (see grpo.config.docs)"


def test_readme_shows_the_two_setup_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def test_the_reward_example_runs_as_documented(tmp_path, monkeypatch):
    """The README's reward example (a Python file and a recipe's rewards) builds through the real config
    loader and scores a batch the way the trainer calls it."""
    import pytest

    pytest.importorskip("trl.rewards")
    from grpo.config import load_config
    from grpo.rewards import build_reward_functions, score
    from grpo.rewards.context import RewardContext, make_trainer_state

    text = README.read_text()
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


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_layout_names_every_module():
    """The README's Layout names every module of src/grpo (by its path under src/grpo), and every dotted
    ``grpo.x.y`` the README names is a module that exists (or an attribute of one)."""
    import importlib
    import importlib.util
    import re

    text = README.read_text()
    layout = _section(text, "## Layout")
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    assert modules
    missing = [m for m in modules if not re.search(rf"(?<![\w/.]){re.escape(m)}(?!\w)", layout)]
    assert not missing, f"modules missing from the README's Layout section: {missing}"

    unresolved = []
    for name in sorted(set(re.findall(r"(?<![\w./-])grpo(?:\.[A-Za-z_]\w*)+", text))):
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
    assert not unresolved, f"the README names modules or attributes that do not exist: {unresolved}"


def test_the_exit_status_table_is_the_codes_own():
    """Every status the README's table lists is one grpo.errors defines, and every one it defines is listed."""
    import re

    from grpo import errors

    text = README.read_text()
    table = text[text.index("Exit status (`grpo.errors`"):]
    table = table[:table.index("\n\n", table.index("| status |"))]
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
