"""Model options (Llama, teacher reference, gradient checkpointing) and the command line end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from run_helpers import REPO, SIGNAL_REWARDS, as_overrides, cli_env, grpo_cmd, read_metrics

from grpo.cli import main
from grpo.config import ConfigError, load_config
from grpo.training.colocated import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def overrides(model_dir: Path, out: Path, **extra) -> list[str]:
    return as_overrides({
        "model.name_or_path": str(model_dir), "data.train": "synthetic:seed=1,n=32",
        "rollout.num_generations": 4, "rollout.max_completion_length": 8, "train.prompts_per_step": 2,
        "train.micro_batch_size": 4, "train.max_steps": 2, "train.save_steps": 2, "train.output_dir": str(out),
        "optim.learning_rate": 1e-3, "log.report_to": "[]", "log.progress_bar": False, "log.plots": False,
        "rewards": SIGNAL_REWARDS,
        **extra,
    })


def test_llama_architecture_trains(tiny_tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "tiny-llama"
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                         eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    result = train(load_config(None, overrides(model_dir, tmp_path / "run")))
    assert result.last_step == 2 and (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_teacher_reference_and_gradient_checkpointing(tiny_model_dir, tiny_tokenizer, tmp_path):
    from grpo.models.tiny import build_qwen2

    teacher = tmp_path / "teacher"  # larger model, same tokenizer: a valid reference
    build_qwen2(tiny_tokenizer, hidden_size=96, num_layers=3, seed=5).save_pretrained(teacher)
    tiny_tokenizer.save_pretrained(teacher)
    out = tmp_path / "run"
    train(load_config(None, overrides(tiny_model_dir, out, **{
        "model.ref_name_or_path": str(teacher), "model.gradient_checkpointing": True, "loss.beta": 0.5})))
    rows = read_metrics(out)
    # A different model as reference: KL is clearly positive from the first step (a copy would give 0).
    assert rows[0]["kl"] > 1e-3


def test_reference_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from grpo.models.tiny import build_qwen2, build_tokenizer

    other_tok = build_tokenizer(["completely different corpus", "with other merges 123"], vocab_size=300)
    other = tmp_path / "other"
    build_qwen2(other_tok).save_pretrained(other)
    other_tok.save_pretrained(other)
    cfg = load_config(None, overrides(tiny_model_dir, tmp_path / "run", **{"model.ref_name_or_path": str(other)}))
    with pytest.raises(ConfigError, match="different tokenizer"):
        train(cfg)


def test_model_without_chat_template_is_refused(tiny_tokenizer, tmp_path):
    from grpo.models.tiny import build_qwen2

    bare = tmp_path / "bare"
    build_qwen2(tiny_tokenizer).save_pretrained(bare)
    tiny_tokenizer.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no chat template"):
        train(load_config(None, overrides(bare, tmp_path / "run")))


def test_cli_train_eval_chat_export_and_exit_codes(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    smoke = str(REPO / "configs" / "smoke-cpu.yaml")
    args = overrides(tiny_model_dir, out, **{"data.eval": "synthetic:seed=123,n=4", "train.max_steps": 2})
    assert main(["train", smoke, *args]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert main(["train", smoke, *args]) == 2  # the folder holds a run: refused without --resume/--overwrite
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", smoke, *args, "train.max_steps=3", "--resume"]) == 0
    steps = [r["step"] for r in read_metrics(out)]
    assert [s for s in steps if s > 0] == [1, 2, 2, 3, 3]  # steps 1-2, resumed 3 (eval rows repeat the step)

    report = tmp_path / "eval.json"
    assert main(["eval", str(out), "--data", "synthetic:seed=7,n=4", "--output", str(report), "--no-progress",
                 "--max-new-tokens", "8"]) == 0
    assert {"accuracy", "format_rate", "n"} <= set(json.loads(report.read_text()))
    assert main(["chat", str(out), "--prompt", "What is 2 + 3?", "--max-new-tokens", "5"]) == 0
    exported = tmp_path / "exported"
    assert main(["export", str(out / "checkpoints" / "step-3"), str(exported)]) == 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(exported)
    assert main(["train", smoke, "train.max_stepz=3"]) == 2
    assert "did you mean train.max_steps" in capsys.readouterr().err
    assert main(["train", smoke, *overrides(tiny_model_dir, tmp_path / "r2", **{"data.train": "missing.jsonl"})]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_ctrl_c_writes_a_checkpoint_and_exits_130(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = grpo_cmd("train", *overrides(tiny_model_dir, out, **{"train.max_steps": 500, "train.save_steps": 1000}))
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    checkpoints = list((out / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 1, "Ctrl-C saved the last finished step"
    logged = [r["step"] for r in read_metrics(out)]
    assert int(checkpoints[0].name.split("-")[1]) == max(logged)


def test_eval_steps_and_early_stop(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # Any accuracy reaches a target of 0: the run stops after the first periodic evaluation.
    result = train(load_config(None, overrides(tiny_model_dir, out, **{
        "data.eval": "synthetic:seed=123,n=4", "train.eval_steps": 1, "train.early_stop_accuracy": 0.0,
        "train.max_steps": 5, "train.save_steps": 10})))
    assert result.last_step == 1
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "eval/accuracy" in r][:2] == [0, 1]
    assert (out / "checkpoints" / "step-1").exists() and (out / "final").exists()
