"""Every shipped recipe (``configs/*.yaml``) trains two steps through the command line.

A recipe is run as shipped except for what a CPU test cannot hold: its model becomes a tiny random
model of the same architecture family and embedding tying (the test tokenizer, a Qwen-style byte BPE; a
recipe with tools keeps its model's own tokenizer, whose chat template renders them),
a separate reference becomes a larger tiny teacher of the reference's family sharing that tokenizer,
hub data becomes a local GSM8K folder (train.jsonl / test.jsonl, read with the recipe's own splits), a public
K&K file (``kk:path=``, not shipped) and generated K&K puzzles become generated puzzles of 2 people (what the
byte tokenizer renders within the recipe's max_prompt_length; Qwen's needs a third of the tokens for a
7-person quiz, the tiny K&K model's tokenizer about half for a 3-person one),
evaluation sees 4 prompts, bf16 is off without CUDA, the run writes to a temporary folder (no plots) and
stops after 2 steps. LoRA, gradient checkpointing, rewards, loss, prompts per step, group size, batch and
micro-batch sizes, generation length and the rest are the recipe's, so a combination of settings
that crashes on a GPU crashes here first (issue 13: the LoRA + checkpointing recipe died at step 1).
A new recipe is covered by adding its file; a new model family needs a builder in ``TINY_BUILDERS``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_helpers import read_metrics

from grpo.cli import main
from grpo.config import load_config
from grpo.data import generate_problems, write_gsm8k_jsonl
from grpo.data.locations import looks_like_hub_id
from grpo.models.tiny import build_qwen2
from grpo.commands.memory.shapes import load_model_config
from grpo.training.evaluator import eval_sources

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs").glob("*.yaml"))
def build_qwen2_moe(tokenizer, *, hidden_size: int, num_layers: int, tie_word_embeddings: bool, seed: int):
    """A tiny random Qwen2-MoE (configs/moe-demo-cpu.yaml's family: 4 experts, 2 per token)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                            num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=2 * hidden_size,
                            shared_expert_intermediate_size=hidden_size, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True, tie_word_embeddings=tie_word_embeddings, max_position_embeddings=512,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return Qwen2MoeForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng)


# config.json model_type -> builder of a tiny random model
TINY_BUILDERS = {"qwen2": build_qwen2, "qwen2_moe": build_qwen2_moe}
STEPS = 2
EVAL_PROMPTS = 4


def family(name_or_path: str, key: str) -> tuple[str, dict]:
    """(model_type, config.json) of a recipe's model, offline (local folder, HF cache, built-in table)."""
    config, _ = load_model_config(str(REPO / name_or_path) if (REPO / name_or_path).exists() else name_or_path, key)
    model_type = config.get("model_type")
    if model_type not in TINY_BUILDERS:
        pytest.fail(f"{key}: {name_or_path!r} is a {model_type!r} model; add a builder of a tiny model of that "
                    f"family to TINY_BUILDERS (known: {', '.join(TINY_BUILDERS)})")
    return model_type, config


def answers_end(model, eos_token_id: int, shared: float = 1.0, eos_extra: float = 0.4) -> None:
    """Give a random model's sampled answers an end, as an instruct model's have, instead of the
    recipe's whole budget (measured on these prompts: ~4 tokens on average, the longest of 128 ~14; with
    ``eos_extra`` 0.25, ~15 and ~100, the 1.5B recipes' two steps took 1.7x as long).

    A random model almost never samples its EOS, so every one of a recipe's completions would run all
    512 tokens (minutes on a CPU). One direction added to every embedding row dominates every hidden
    state; the LM head rows (the same rows when tied) all carry it too, so it shifts every logit alike,
    except EOS's, whose row carries ``eos_extra`` more: a steady EOS probability of ~20% per token."""
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    heads = [model.get_input_embeddings().weight]
    if not model.config.tie_word_embeddings:
        heads.append(model.get_output_embeddings().weight)
    with torch.no_grad():
        for rows in heads:
            rows.add_(shared * direction)
            rows[eos_token_id].add_(eos_extra * direction)


def tiny_like(name_or_path: str, key: str, tokenizer, out: Path, *, hidden_size: int, num_layers: int,
              extra_rows: int = 0) -> Path:
    """Save a tiny random model of ``name_or_path``'s family and tying, with ``tokenizer`` beside it;
    ``extra_rows`` pads its embedding past the tokenizer, as a large checkpoint's may be."""
    model_type, config = family(name_or_path, key)
    model = TINY_BUILDERS[model_type](tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                                      tie_word_embeddings=config.get("tie_word_embeddings", True), seed=num_layers)
    answers_end(model, tokenizer.eos_token_id)
    if extra_rows > 0:
        model.resize_token_embeddings(len(tokenizer) + extra_rows)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def gsm8k_folder(path: Path) -> Path:
    """A local stand-in for openai/gsm8k: GSM8K rows (``{question, answer: "...\\n#### N"}``) per split."""
    path.mkdir()
    write_gsm8k_jsonl(generate_problems(40, seed=11, difficulty="demo"), path / "train.jsonl")
    write_gsm8k_jsonl(generate_problems(EVAL_PROMPTS, seed=12, difficulty="demo"), path / "test.jsonl")
    return path


def recipe_overrides(recipe: Path, tokenizer, tmp_path: Path) -> list[str]:
    """The ``key=value`` swaps that make ``recipe`` runnable on a CPU in seconds (module docstring)."""
    cfg = load_config(recipe)
    if cfg.rollout.tools or cfg.rollout.environment:  # its own tokenizer: the chat template renders the tools
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(REPO / cfg.model.name_or_path)
    # no plots: they draw metrics.jsonl after training (tests/test_plots.py), seconds a recipe here
    swaps: dict[str, object] = {"train.output_dir": tmp_path / "run", "train.max_steps": STEPS, "log.plots": "false"}
    swaps["model.name_or_path"] = tiny_like(cfg.model.name_or_path, "model.name_or_path", tokenizer,
                                            tmp_path / "policy", hidden_size=64, num_layers=2)
    ref = cfg.model.ref_name_or_path
    if ref is not None:  # a teacher larger than the policy, with as many more embedding rows as the real one
        extra_rows = (family(ref, "model.ref_name_or_path")[1]["vocab_size"]
                      - family(cfg.model.name_or_path, "model.name_or_path")[1]["vocab_size"])
        swaps["model.ref_name_or_path"] = tiny_like(ref, "model.ref_name_or_path", tokenizer, tmp_path / "teacher",
                                                    hidden_size=96, num_layers=3, extra_rows=extra_rows)
    eval_sets = list(eval_sources(cfg.data.eval).values())  # a recipe's named sets or its one source
    if looks_like_hub_id(cfg.data.train) or any(looks_like_hub_id(source) for source in eval_sets):
        folder = gsm8k_folder(tmp_path / "gsm8k")
        swaps["data.train"] = folder
        if cfg.data.eval is not None:
            swaps["data.eval"] = folder
    if cfg.data.train.startswith("kk:"):
        swaps["data.train"] = "kk:seed=1,n=128,people=2"
    if any(source.startswith("kk:") for source in eval_sets):
        swaps["data.eval"] = f"kk:seed=2,n={EVAL_PROMPTS},people=2"
    if cfg.data.eval is not None:
        swaps["data.eval_limit"] = min(cfg.data.eval_limit or EVAL_PROMPTS, EVAL_PROMPTS)
    if cfg.model.bf16 and not torch.cuda.is_available():
        swaps["model.bf16"] = "false"
    return [f"{key}={value}" for key, value in swaps.items()]


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_trains_two_steps(recipe, tiny_tokenizer, tmp_path, monkeypatch):
    overrides = recipe_overrides(recipe, tiny_tokenizer, tmp_path)
    monkeypatch.chdir(REPO)  # as the recipes' launch lines run: their relative paths resolve here
    assert main(["train", str(recipe), *overrides]) == 0, f"{recipe.name}: {' '.join(overrides)}"
    rows = read_metrics(tmp_path / "run")
    trained = [row["step"] for row in rows if "loss" in row]
    assert trained == list(range(1, STEPS + 1)), f"{recipe.name}: training rows for steps {trained}"
