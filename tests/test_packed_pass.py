"""Padding-free log-prob passes (``train.pack_sequences``): each micro-batch's rows packed into one sequence of
their real tokens equal the padded pass in values, entropy and gradients, for tied and untied heads, LoRA, the
fused head, the sampling controls and gradient checkpointing; and no padding position is run."""

from __future__ import annotations

import pytest
import torch

from grpo.algorithm import LogprobProcessing
from grpo.models.tiny import build_qwen2
from grpo.step.logprobs import completion_logprobs, packed_layout

from test_fused_head import MODELS, assert_passes_agree
from test_logprobs import grouped_rows


def assert_packed_equals_padded(model, rows, **options):
    common = dict(share_prompts=False, **options)
    assert_passes_agree(model, rows, dict(common, pack=False), dict(common, pack=True))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_pass_equals_the_padded_pass(tiny_tokenizer, name, fused):
    model = MODELS[name](tiny_tokenizer).train()
    assert_packed_equals_padded(model, grouped_rows(len(tiny_tokenizer), [7, 4, 11], G=3), fused_head=fused)


def test_packed_pass_follows_the_sampling_controls_and_checkpointing(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    processing = LogprobProcessing(repetition_penalty=1.3, min_new_tokens=2, min_p=0.05,
                                   eos_ids=(tiny_tokenizer.eos_token_id,))
    assert_packed_equals_padded(model, grouped_rows(len(tiny_tokenizer), [6, 9], G=3), processing=processing)


def test_packed_pass_runs_only_real_tokens(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    rows = grouped_rows(len(tiny_tokenizer), [3, 10], G=2, Lc=12)
    run = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: run.append(args[0].shape))
    with torch.no_grad():
        completion_logprobs(model, *rows, temperature=1.0, pack=True)
    real = int(rows[1].sum() + rows[3].sum())
    assert run == [torch.Size([1, real])]  # one packed sequence of exactly the real tokens


def test_packed_layout_positions_and_scored_indices():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    real, positions, scored = packed_layout(prompt_mask, completion_mask, 3)
    assert positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # row 0: 2 + 2 tokens, row 1: 3 + 1
    # row 0 starts at 0: its prompt's last token is packed index 1, then its completion (2, 3), clamped at 3;
    # row 1 starts at 4: prompt's last token 6, its one completion token 7, then clamped at 7
    assert scored.tolist() == [[1, 2, 3, 3], [6, 7, 7, 7]]
    assert real.sum() == 8
