"""Model sources (run / checkpoint / adapter folders), chat with the run's system prompt, and export
(a LoRA checkpoint merged into a plain HF model with the same logits; a full model round trip)."""

from __future__ import annotations

import json

import pytest
import torch

from grpo.config import ConfigError, dump_config, load_config
from grpo.data.tags import get_tag_style
from grpo.models.source import load_model_for_inference, resolve_model_source


def fake_model(folder):
    """Files that make a folder look like a HF model (resolution never loads them)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def write_run_config(run_dir, *overrides):
    dump_config(load_config(None, list(overrides)), run_dir / "config.yaml")


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tiny_tokenizer):
    """A saved random tiny Qwen2 (model + tokenizer)."""
    from grpo.models.tiny import build_qwen2

    folder = tmp_path_factory.mktemp("base")
    build_qwen2(tiny_tokenizer, seed=1).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, saved_tiny, tiny_tokenizer):
    """A LoRA adapter on ``saved_tiny`` with random (non-zero) A and B, saved as a run's checkpoint."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path_factory.mktemp("lora-run")
    base = AutoModelForCausalLM.from_pretrained(saved_tiny)  # records base_model_name_or_path
    torch.manual_seed(0)
    # init_lora_weights=False: B is random too, so the adapter really changes the outputs.
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, lora)
    folder = run / "checkpoints" / "step-3"
    peft_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    write_run_config(run, "model.lora_r=4", f"model.name_or_path={saved_tiny}")
    return folder


def test_run_dir_prefers_final_then_newest_step(tmp_path):
    run = tmp_path / "run"
    for step in (2, 9, 10):
        fake_model(run / "checkpoints" / f"step-{step}")
    (run / "checkpoints" / "step-11").mkdir()  # torn: no model files, skipped
    source = resolve_model_source(run)
    assert source.model_dir == run / "checkpoints" / "step-10"  # numeric order: 10 after 9
    assert source.run_dir == run and source.config is None and not source.is_adapter
    fake_model(run / "final")
    assert resolve_model_source(run).model_dir == run / "final"
    # A checkpoint folder given directly is used as is and still knows its run.
    direct = resolve_model_source(run / "checkpoints" / "step-2")
    assert direct.model_dir == run / "checkpoints" / "step-2" and direct.run_dir == run


def test_run_config_supplies_tag_style_and_system_prompt(tmp_path):
    run = tmp_path / "run"
    fake_model(run / "final")
    assert resolve_model_source(run).system_prompt == get_tag_style("think").system_prompt
    write_run_config(run, "data.tag_style=reasoning")
    source = resolve_model_source(run / "final")
    assert source.tag_style == "reasoning"
    assert source.system_prompt == get_tag_style("reasoning").system_prompt
    write_run_config(run, "data.tag_style=reasoning", "data.system_prompt=Answer tersely.")
    assert resolve_model_source(run).system_prompt == "Answer tersely."


def test_missing_or_empty_paths_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_source(tmp_path / "nope")
    with pytest.raises(ConfigError, match="holds no model"):
        resolve_model_source(tmp_path)
    (tmp_path / "checkpoints" / "step-1").mkdir(parents=True)
    with pytest.raises(ConfigError, match="none of the checkpoints"):
        resolve_model_source(tmp_path)


def test_adapter_source_reads_base_from_adapter_config(lora_checkpoint, saved_tiny):
    source = resolve_model_source(lora_checkpoint.parent.parent)
    assert source.model_dir == lora_checkpoint
    assert source.is_adapter and source.base_model == str(saved_tiny)
    assert source.config is not None and source.config.model.lora_r == 4


def test_chat_prompt_uses_run_system_prompt(saved_tiny, tmp_path, monkeypatch, capsys):
    import shutil

    from grpo.rollout import LeanEngine
    from grpo.commands import chat

    run = tmp_path / "run"
    shutil.copytree(saved_tiny, run / "final")
    write_run_config(run, "data.system_prompt=You are CHAT-TEST-BOT.")
    rendered = []
    original = LeanEngine.generate

    def recording_generate(self, prompts, params, seed=None):
        rendered.extend(prompts)
        return original(self, prompts, params, seed)

    monkeypatch.setattr(LeanEngine, "generate", recording_generate)
    conversation = chat.run_chat(run, prompt="What is 2 + 3?", max_new_tokens=6, device="cpu")
    assert len(rendered) == 1
    assert rendered[0].startswith("<|im_start|>system\nYou are CHAT-TEST-BOT.<|im_end|>\n")
    assert "What is 2 + 3?" in rendered[0] and rendered[0].endswith("<|im_start|>assistant\n")
    assert [m["role"] for m in conversation] == ["system", "user", "assistant"]
    reply = conversation[-1]["content"]
    assert capsys.readouterr().out == reply + "\n"


def test_chat_loop_keeps_history(saved_tiny, monkeypatch, capsys):
    from grpo.rollout import LeanEngine
    from grpo.commands import chat

    rendered = []
    original = LeanEngine.generate

    def recording_generate(self, prompts, params, seed=None):
        rendered.extend(prompts)
        return original(self, prompts, params, seed)

    monkeypatch.setattr(LeanEngine, "generate", recording_generate)
    lines = iter(["first question", "", "second question", "exit", "never read"])
    conversation = chat.run_chat(saved_tiny, max_new_tokens=4, device="cpu", input_fn=lambda _: next(lines))
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert len(rendered) == 2
    first_reply = conversation[2]["content"]
    # The second turn's prompt holds the whole first exchange.
    assert f"first question<|im_end|>\n<|im_start|>assistant\n{first_reply}<|im_end|>" in rendered[1]
    assert get_tag_style("think").system_prompt in rendered[1]

    def eof(_):  # Ctrl-D ends the loop too
        raise EOFError

    assert chat.run_chat(saved_tiny, device="cpu", input_fn=eof) == [
        {"role": "system", "content": get_tag_style("think").system_prompt}]


def _logits(model, tokenizer):
    ids = tokenizer(["What is 12 + 7? <think>", "Tom has 3 apples"], padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits


def test_export_lora_checkpoint_merges_into_plain_model(lora_checkpoint, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from grpo.commands.export import export_model

    source = resolve_model_source(lora_checkpoint)
    unmerged, tokenizer = load_model_for_inference(source, "cpu", merge=False)
    assert isinstance(unmerged, PeftModel)
    expected = _logits(unmerged, tokenizer)
    with unmerged.disable_adapter():
        base_logits = _logits(unmerged, tokenizer)
    assert (expected - base_logits).abs().max() > 1e-3  # the adapter matters, so the check below can fail

    out = export_model(lora_checkpoint.parent.parent, tmp_path / "exported")  # the run folder
    files = {p.name for p in out.iterdir()}
    assert "model.safetensors" in files and "tokenizer.json" in files and "adapter_config.json" not in files
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert not [k for k in weights.keys() if "lora" in k]
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(plain).__name__ == "Qwen2ForCausalLM"
    torch.testing.assert_close(_logits(plain, tokenizer), expected, atol=1e-5, rtol=0)


def test_export_full_model_round_trip_and_overwrite(saved_tiny, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.commands.export import export_model

    out = tmp_path / "out"
    export_model(saved_tiny, out)
    original = AutoModelForCausalLM.from_pretrained(saved_tiny).eval()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(_logits(exported, tiny_tokenizer), _logits(original, tiny_tokenizer))
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tiny_tokenizer.get_vocab()

    with pytest.raises(ConfigError, match="not empty"):
        export_model(saved_tiny, out)
    (out / "stale.txt").write_text("from before")
    export_model(saved_tiny, out, dtype="bfloat16", overwrite=True)
    assert not (out / "stale.txt").exists()  # replaced, not merged into
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="contains the model"):
        export_model(saved_tiny, saved_tiny, overwrite=True)
