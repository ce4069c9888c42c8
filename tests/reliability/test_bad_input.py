"""Bad input at the command line: exit 2, a message naming the key / file:line, and the run folder
being resumed left byte-identical (nothing is written before setup succeeds)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from reliability_helpers import RECIPE, run_args, snapshot
from run_helpers import rewards_on_path

from grpo.cli import main

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


@pytest.fixture(scope="module")
def existing_run(tiny_model_dir, recipe, tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoints of steps 1 and 2, metrics, samples, final): what a typo in a
    ``--resume`` command must not damage."""
    out = tmp_path_factory.mktemp("existing") / "run"
    with rewards_on_path():
        assert main(["train", str(recipe), *run_args(tiny_model_dir, out)]) == 0
    assert (out / "checkpoints" / "step-2").is_dir() and (out / "final").is_dir()
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_tokenizer) -> Path:
    """Bad files: data, recipes, a model without a chat template, a model of another vocabulary."""
    from grpo.models.tiny import build_qwen2, build_tokenizer

    root = tmp_path_factory.mktemp("bad-inputs")
    good = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})
    (root / "empty.jsonl").write_text("")
    (root / "malformed.jsonl").write_text(good + "\n" + '{"question": "What is 1 + 1?", "answer": \n')
    (root / "no_marker.jsonl").write_text(good + "\n" + json.dumps({"question": "Q?", "answer": "It is 5."}) + "\n")
    (root / "not_a_number.jsonl").write_text(
        good + "\n" + good + "\n" + json.dumps({"question": "Q?", "answer": "so\n#### twelve"}) + "\n")
    (root / "typo.yaml").write_text(RECIPE.replace("  max_steps: 2", "  max_stepz: 2"))
    (root / "wrong_type.yaml").write_text(RECIPE.replace("  max_completion_length: 8", "  max_completion_length: many"))

    bare = root / "no-chat-template"
    build_qwen2(tiny_tokenizer).save_pretrained(bare)
    tiny_tokenizer.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((bare / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    other_tokenizer = build_tokenizer(["completely different corpus", "with other merges 123"], vocab_size=300)
    other = root / "other-vocabulary"
    build_qwen2(other_tokenizer).save_pretrained(other)
    other_tokenizer.save_pretrained(other)

    (root / "broken_reward_module.py").write_text("def reward(prompts, completions, **kw)\n    return [0.0]\n")
    return root


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if text in line)


# (id, arguments after `grpo train` given the inputs folder, the message's kind, a regex the message must match)
CASES = [
    ("unknown key, did you mean", lambda d: ["train.max_stepz=3"],
     "configuration", r"unknown key train\.max_stepz; did you mean train\.max_steps\?"),
    ("unknown key in the recipe, file:line", lambda d: ["--recipe", d / "typo.yaml"],
     "configuration", lambda d: rf"{re.escape(str(d / 'typo.yaml'))}:{line_of(d / 'typo.yaml', 'max_stepz')}: "
                                r"unknown key train\.max_stepz; did you mean train\.max_steps\?"),
    ("wrong type", lambda d: ["train.max_steps=abc"],
     "configuration", r"train\.max_steps: expected int, got 'abc'"),
    ("wrong type in the recipe, file:line", lambda d: ["--recipe", d / "wrong_type.yaml"],
     "configuration", lambda d: rf"{re.escape(str(d / 'wrong_type.yaml'))}:"
                                rf"{line_of(d / 'wrong_type.yaml', 'many')}: rollout\.max_completion_length: "
                                r"expected int"),
    ("out-of-range value", lambda d: ["rollout.temperature=0"],
     "configuration", r"rollout\.temperature: 0\.0 is out of range: must be > 0"),
    ("invalid combination: micro-batch", lambda d: ["train.micro_batch_size=3"],
     "configuration", r"train\.micro_batch_size.*does not divide the step's 8 completions"),
    ("invalid combination: LoRA learning rate without LoRA", lambda d: ["optim.lora_learning_rate=1e-4"],
     "configuration", r"optim\.lora_learning_rate.*model\.lora_r is 0"),
    ("missing model path", lambda d: [f"model.name_or_path={d / 'no-such-model'}"],
     "configuration", r"model\.name_or_path: '.*no-such-model' does not exist"),
    ("model without a chat template", lambda d: [f"model.name_or_path={d / 'no-chat-template'}"],
     "configuration", r"model\.name_or_path: the tokenizer of '.*no-chat-template' has no chat template"),
    ("reference of another vocabulary", lambda d: [f"model.ref_name_or_path={d / 'other-vocabulary'}"],
     "configuration", r"model\.ref_name_or_path: '.*other-vocabulary' has a different tokenizer"),
    ("dataset file missing", lambda d: [f"data.train={d / 'missing.jsonl'}"],
     "data", r"missing\.jsonl: file not found"),
    ("dataset file empty", lambda d: [f"data.train={d / 'empty.jsonl'}"],
     "data", r"empty\.jsonl: file is empty"),
    ("malformed JSON line", lambda d: [f"data.train={d / 'malformed.jsonl'}"],
     "data", r"malformed\.jsonl:2: invalid JSON"),
    ("answer without ####", lambda d: [f"data.train={d / 'no_marker.jsonl'}"],
     "data", r"no_marker\.jsonl:2: GSM8K answer has no '####' marker"),
    ("non-numeric gold", lambda d: [f"data.train={d / 'not_a_number.jsonl'}"],
     "data", r"not_a_number\.jsonl:3: GSM8K gold answer after '####' is not a number: 'twelve'"),
    ("held-out file missing", lambda d: [f"data.eval={d / 'missing-eval.jsonl'}"],
     "data", r"missing-eval\.jsonl: file not found"),
    ("reward module that does not exist", lambda d: ["rewards=[{name: 'no_such_module:reward'}]"],
     "configuration", r"rewards: reward 'no_such_module:reward': no module named 'no_such_module'"),
    ("reward function that does not exist", lambda d: ["rewards=[{name: 'rewards_for_reliability:nope'}]"],
     "configuration", r"rewards: .*has no attribute 'nope'"),
    ("reward module that does not import (syntax error)",
     lambda d: ["rewards=[{name: 'broken_reward_module:reward'}]"],
     "configuration", (r"rewards: reward 'broken_reward_module:reward' does not import: "
                       r".*broken_reward_module\.py:1: SyntaxError")),
    ("unknown reward name", lambda d: ["rewards=[{name: answer_corect}]"],
     "configuration", r"rewards: unknown reward 'answer_corect'; known: .*answer_correct"),
]


@pytest.mark.parametrize("make_args,kind,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_naming_it_and_leaves_the_run_untouched(existing_run, inputs, recipe, tiny_model_dir,
                                                                   make_args, kind, expected, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(inputs))  # for the reward module with a syntax error
    args = make_args(inputs)
    if args[0] == "--recipe":
        recipe, args = args[1], args[2:]
    before = snapshot(existing_run)
    capsys.readouterr()
    status = main(["train", str(recipe), *run_args(tiny_model_dir, existing_run), *map(str, args), "--resume"])
    err = capsys.readouterr().err
    assert status == 2, err
    pattern = expected(inputs) if callable(expected) else expected
    message = [line for line in err.splitlines() if line.startswith("grpo: ")]  # not the progress bars
    assert len(message) == 1 and message[0].startswith(f"grpo: {kind} error: "), err
    assert re.search(pattern, message[0]), f"{pattern!r} not in {message[0]!r}"
    assert snapshot(existing_run) == before, "a failed --resume changed the run folder"


def test_bad_input_with_overwrite_keeps_the_old_run(existing_run, inputs, recipe, tiny_model_dir, tmp_path, capsys):
    # --overwrite deletes the old run only once the new one's setup succeeded.
    out = tmp_path / "run"
    shutil.copytree(existing_run, out)
    before = snapshot(out)
    status = main(["train", str(recipe), *run_args(tiny_model_dir, out, **{"data.train": inputs / "empty.jsonl"}),
                   "--overwrite"])
    assert status == 2 and "file is empty" in capsys.readouterr().err
    assert snapshot(out) == before


def resume_with_reward(existing_run, recipe, tiny_model_dir, tmp_path, capsys, reward: str) -> str:
    """Resume a copy of the finished 2-step run for a third step scored by ``reward`` alone; assert exit 2 and
    that the checkpoints, metrics, samples and final weights of steps 1-2 are as they were. Returns stderr."""
    out = tmp_path / "run"
    shutil.copytree(existing_run, out)
    kept = {k: v for k, v in snapshot(out).items() if k.startswith(("checkpoints", "metrics", "samples", "final"))}
    status = main(["train", str(recipe), *run_args(tiny_model_dir, out, **{
        "train.max_steps": 3, "rewards": f"[{{name: '{reward}'}}]"}), "--resume"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert {k: v for k, v in snapshot(out).items() if k in kept} == kept
    assert "step-3" not in {p.name for p in (out / "checkpoints").iterdir()}
    return err


def test_reward_of_the_wrong_length_exits_2_and_keeps_checkpoints_and_metrics(existing_run, recipe, tiny_model_dir,
                                                                              tmp_path, capsys):
    # Found only when step 3 scores its completions: by then the run is set up (config.yaml records the
    # resumed command); the checkpoints and the metrics and samples of steps 1-2 must be as they were.
    err = resume_with_reward(existing_run, recipe, tiny_model_dir, tmp_path, capsys,
                                "rewards_for_reliability:one_too_many")
    assert re.search(r"grpo: reward error: reward 'one_too_many' returned 9 values for 8 completions", err), err


def test_reward_failing_on_every_sample_exits_2_naming_it_and_keeps_the_run(existing_run, recipe, tiny_model_dir,
                                                                             tmp_path, capsys):
    # Before this rule the run trained to the end with exit 0 and a null reward column: every sample
    # "abstained". Now the first step it scores stops the run, before any update uses the batch.
    err = resume_with_reward(existing_run, recipe, tiny_model_dir, tmp_path, capsys,
                                "rewards_for_reliability:raises_always")
    assert re.search(r"reward 'raises_always' failed on every one of the 8 samples of this step.*KeyError: 'gold'",
                     err), err
    assert "sample prompt:" in err and "sample completion:" in err
