"""Completion log-probs with the prompt run once per group must equal the plain one-sequence-per-row
pass (values and gradients), however groups, padding and micro-batches fall."""

from __future__ import annotations

import types

import pytest
import torch

from grpo.models.tiny import build_qwen2
from grpo.step.checkpointing import checkpointed_layers
from grpo.step.logprobs import _shared_prompt_logits, can_share_prompt_cache, checkpointing_paused, completion_logprobs, shared_prompt_index


def grouped_rows(vocab: int, prompt_lengths: list[int], G: int, Lc: int = 9, seed: int = 0):
    """Left-padded prompts of the given lengths, each repeated for G rows; right-padded completions of
    random lengths (1..Lc)."""
    gen = torch.Generator().manual_seed(seed)
    Lp = max(prompt_lengths)
    prompt_ids = torch.zeros(len(prompt_lengths), Lp, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, length in enumerate(prompt_lengths):
        prompt_ids[row, Lp - length:] = torch.randint(3, vocab, (length,), generator=gen)
        prompt_mask[row, Lp - length:] = 1
    N = len(prompt_lengths) * G
    lengths = torch.randint(1, Lc + 1, (N,), generator=gen)
    completion_mask = (torch.arange(Lc)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, vocab, (N, Lc), generator=gen) * completion_mask
    return (prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), completion_ids, completion_mask)


def logprobs_and_grads(model, rows, micro_batch_size, share):
    model.zero_grad(set_to_none=True)
    logprobs = completion_logprobs(model, *rows, temperature=0.7, micro_batch_size=micro_batch_size,
                                   share_prompts=share)  # [N, Lc]
    (logprobs * rows[3]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


def assert_same(model, rows, micro_batch_size):
    plain = logprobs_and_grads(model, rows, micro_batch_size, share=False)
    assert_matches(logprobs_and_grads(model, rows, micro_batch_size, share=True), plain, rows)


def assert_matches(shared, plain, rows):
    """``logprobs_and_grads`` results: the same log-probs on real tokens and the same gradient per parameter."""
    (shared, shared_grads), (plain, plain_grads), mask = shared, plain, rows[3].bool()
    torch.testing.assert_close(shared[mask], plain[mask], atol=2e-5, rtol=1e-5)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("micro_batch_size", [None, 4, 6, 1])
def test_shared_prompt_pass_equals_one_sequence_per_row(tiny_tokenizer, micro_batch_size):
    # micro-batches of 4 split the groups of 3 (a group over two micro-batches); 1 shares nothing
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).train()
    rows = grouped_rows(len(tiny_tokenizer), [7, 4, 11], G=3)
    assert_same(model, rows, micro_batch_size)


def test_shared_prompt_pass_equals_plain_for_lora(tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    base = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.train()
    assert_same(model, grouped_rows(len(tiny_tokenizer), [5, 8], G=4, seed=2), None)


def test_shared_prompt_pass_runs_each_prompt_once(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_rows(len(tiny_tokenizer), [6, 6, 6], G=4)
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
    with torch.no_grad():
        completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0)
    assert sum(embedded) == 3 * 6 + 12 * completion_ids.shape[1]  # 3 prompts once, then the 12 completions
    embedded.clear()
    with torch.no_grad():
        completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0, share_prompts=False)
    assert sum(embedded) == 12 * (6 + completion_ids.shape[1])


def checkpointing_model(tokenizer, use_reentrant: bool, seed: int = 0, lora: bool = False):
    model = build_qwen2(tokenizer, hidden_size=32, num_layers=2, seed=seed)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    return model.train()


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_shares_prompts_with_the_plain_pass_values_and_gradients(tiny_tokenizer,
                                                                                        use_reentrant, lora):
    # Hugging Face drops the KV cache of a checkpointing model in training; grpo checkpoints the completion
    # pass itself over a read-only cache (non-reentrant whatever the model asked: the prompt's keys and values
    # reach the completion layers through the cache, not as checkpoint inputs).
    model = checkpointing_model(tiny_tokenizer, use_reentrant, seed=1, lora=lora)
    assert can_share_prompt_cache(model)
    rows = grouped_rows(len(tiny_tokenizer), [5, 9], G=3)
    before = checkpointing_state(model)
    layers = checkpointed_layers(model)
    assert len(layers) == 2
    embedded, layer_runs = [], []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
    for layer in layers:  # the attention is called inside the layer's forward: its hook sees the recompute too
        layer.self_attn.register_forward_pre_hook(lambda module, args, kwargs: layer_runs.append(1), with_kwargs=True)
    shared = logprobs_and_grads(model, rows, None, share=True)
    width = int(rows[3].any(0).nonzero().max()) + 1  # the pass runs no column that every row pads
    assert embedded == [2 * 9, 6 * width]  # the 2 distinct prompts once (padded to 9), then the 6 completions
    # each layer: the prompt pass, the completion pass, and the completion pass again in the backward's recompute
    assert len(layer_runs) == 2 * 3
    assert checkpointing_state(model) == before and not any("forward" in vars(layer) for layer in layers)
    for module in model.modules():  # the reference: the same weights, no checkpointing, one sequence per row
        if "gradient_checkpointing" in vars(module):
            module.gradient_checkpointing = False
    assert_matches(shared, logprobs_and_grads(model, rows, None, share=False), rows)


def test_gradient_checkpointing_with_a_cache_grpo_cannot_read_runs_the_plain_pass(tiny_tokenizer, monkeypatch):
    import grpo.step.logprobs as logprobs

    monkeypatch.setattr(logprobs, "read_only", lambda cache: False)  # as for a sliding-window layer
    model = checkpointing_model(tiny_tokenizer, use_reentrant=False)
    rows = grouped_rows(len(tiny_tokenizer), [6, 6], G=3)
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
    shared, _ = logprobs_and_grads(model, rows, None, share=True)
    width = int(rows[3].any(0).nonzero().max()) + 1  # the pass runs no column that every row pads
    assert embedded == [2 * 6, 6 * (6 + width)]  # the wasted prompt pass, then the plain one
    with checkpointing_paused(model):
        plain = completion_logprobs(model, *rows, temperature=0.7, share_prompts=False).detach()
    torch.testing.assert_close(shared[rows[3].bool()], plain[rows[3].bool()], atol=2e-5, rtol=1e-5)


def test_a_checkpointing_module_grpo_cannot_take_over_keeps_the_plain_pass(tiny_tokenizer):
    model = checkpointing_model(tiny_tokenizer, use_reentrant=False)
    model.extra = ClassWideCheckpointing()  # checkpointing on a module that is no Hugging Face decoder layer
    assert not can_share_prompt_cache(model)
    with checkpointing_paused(model):
        assert can_share_prompt_cache(model)
    model.eval()
    assert can_share_prompt_cache(model)


def checkpointing_state(model) -> dict[str, object]:
    """Each module's own ``gradient_checkpointing`` attribute (absent = inherited from its class)."""
    return {name: vars(m).get("gradient_checkpointing", "inherited") for name, m in model.named_modules()}


def test_no_grad_pass_pauses_gradient_checkpointing_and_shares_prompts(tiny_tokenizer):
    # The LoRA reference (adapter off) and old log-probs run on the policy in training mode. With
    # checkpointing on, Hugging Face would return no cache; the no-grad pass pauses checkpointing,
    # shares the prompts and gives the log-probs of the plain pass that training runs.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    before = checkpointing_state(model)
    assert sum(state is True for state in before.values()) == 3  # the base model and its 2 decoder layers
    rows = grouped_rows(len(tiny_tokenizer), [6, 6, 6], G=4)
    plain = completion_logprobs(model, *rows, temperature=0.7, share_prompts=False).detach()  # [12, Lc], under grad
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
    with torch.no_grad():
        shared = completion_logprobs(model, *rows, temperature=0.7)
    assert sum(embedded) == 3 * 6 + 12 * rows[2].shape[1]  # 3 prompts once, then the 12 completions
    mask = rows[3].bool()
    torch.testing.assert_close(shared[mask], plain[mask], atol=2e-5, rtol=1e-5)
    assert checkpointing_state(model) == before
    assert all(m.training for m in model.modules())  # train mode kept (dropout as in the plain pass)


class ClassWideCheckpointing(torch.nn.Module):
    gradient_checkpointing = True  # on for the class, no instance value: pausing must not leave one behind


def test_checkpointing_pause_restores_the_state_after_an_exception(tiny_tokenizer):
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.add_module("class_wide", ClassWideCheckpointing())
    before = checkpointing_state(model)
    with pytest.raises(ValueError, match="inside"), checkpointing_paused(model):
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        raise ValueError("inside")
    assert checkpointing_state(model) == before
    assert before["class_wide"] == "inherited" and model.class_wide.gradient_checkpointing is True


class DropsTheCache(torch.nn.Module):
    """A model that ignores use_cache=True, as transformers before 5.24 did under gradient checkpointing in
    training mode (5.24 returns a cache there)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return types.SimpleNamespace(logits=self.model(**inputs).logits)


def test_a_model_that_returns_no_cache_is_a_clear_error(tiny_tokenizer):
    # Called directly (completion_logprobs would have paused checkpointing).
    model = DropsTheCache(build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0))
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_rows(len(tiny_tokenizer), [4], G=2)
    shared = shared_prompt_index(prompt_ids, prompt_mask)
    with torch.no_grad(), pytest.raises(RuntimeError, match="DropsTheCache returned no KV cache"):
        _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *shared)


def test_shared_prompt_index():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9], [7, 8, 9], [0, 5, 6]])
    mask = (ids != 0).long()
    first, index = shared_prompt_index(ids, mask)
    assert first.tolist() == [0, 2, 5]  # runs of equal rows; a prompt seen again later starts a new run
    assert index.tolist() == [0, 0, 1, 1, 1, 2]
    assert shared_prompt_index(ids[[0, 2, 5]], mask[[0, 2, 5]]) is None  # no row repeats: nothing to share
    same_ids_other_mask = mask.clone()
    same_ids_other_mask[1, 0] = 1
    assert shared_prompt_index(ids[:2], same_ids_other_mask[:2]) is None


def test_columns_that_are_padding_in_a_whole_micro_batch_are_not_run(tiny_tokenizer):
    # Micro-batch 1: short prompts and completions; micro-batch 2: the batch's longest of each.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_rows(len(tiny_tokenizer), [3, 10], G=2, Lc=8)
    completion_mask[:2, 3:] = 0
    completion_ids[:2, 3:] = 0
    completion_mask[2:, :] = 1
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        trimmed = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0,
                                      micro_batch_size=2, share_prompts=False)
        whole = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0,
                                    share_prompts=False)
    assert seen[:2] == [(2, 3 + 3), (2, 10 + 8)]  # the first micro-batch ran 3 prompt + 3 completion columns
    assert trimmed.shape == whole.shape == (4, 8)
    assert torch.all(trimmed[:2, 3:] == 0)
    mask = completion_mask.bool()
    torch.testing.assert_close(trimmed[mask], whole[mask], atol=2e-5, rtol=1e-5)


def test_shared_prompt_pass_equals_plain_with_sliding_window_attention(tiny_tokenizer):
    # The prompt's cache of a sliding-window layer keeps only its last positions; completions must
    # still see exactly the window the one-sequence pass gives them.
    base = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0)
    base.config.use_sliding_window, base.config.sliding_window = True, 6
    base.config.layer_types = ["sliding_attention", "full_attention"]
    model = type(base)(base.config).train()
    assert_same(model, grouped_rows(len(tiny_tokenizer), [9, 4], G=3), None)


@pytest.mark.parametrize("share", [False, True])
def test_bucketed_widths_repeat_shapes_and_change_no_value(tiny_tokenizer, share):
    # On a GPU the run widths are rounded up (train.column_bucket: 64) so kernels and attention plans are reused;
    # the extra columns are padding, masked, so the real positions' log-probs and gradients are unchanged.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0).train()
    rows = grouped_rows(len(tiny_tokenizer), [3, 10, 5, 7], G=2, Lc=9)
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))

    def run(bucket):
        model.zero_grad(set_to_none=True)
        logprobs = completion_logprobs(model, *rows, temperature=0.7, micro_batch_size=4, share_prompts=share,
                                       column_bucket=bucket)
        (logprobs * rows[3]).sum().backward()
        return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, plain_grads = run(1)
    unbucketed, seen[:] = list(seen), []
    bucketed, bucketed_grads = run(4)
    # Prompt widths are multiples of 4 or the whole padded prompt (10); completion widths multiples of 4 or
    # Lc (9); the plain pass runs their sum. Unbucketed, the second micro-batch (prompts of 5 and 7) ran 7.
    prompts, completions = {4, 8, 10}, {4, 8, 9}
    allowed = prompts | completions if share else {p + c for p in prompts for c in completions}
    assert set(seen) <= allowed, (seen, allowed)
    if share:  # without buckets the second micro-batch's prompt pass ran its prompts' 7 columns
        assert 7 in unbucketed and 7 not in seen, (unbucketed, seen)
    mask = rows[3].bool()
    torch.testing.assert_close(bucketed[mask], plain[mask], atol=2e-5, rtol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(bucketed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prompt_gradients_are_the_same_in_every_run(tiny_tokenizer):
    # A group's rows read one prompt's KV cache: their gradients sum into it. Advanced indexing's backward
    # sums them with parallel atomics on the CPU (two identical runs then differed in the last bits); the
    # pass must give, every time, what PyTorch's deterministic algorithms give.
    model = build_qwen2(tiny_tokenizer, hidden_size=64, num_layers=2, seed=0).train()
    rows = grouped_rows(len(tiny_tokenizer), [90, 100, 80], G=7, Lc=12, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.use_deterministic_algorithms(True)
        try:
            _, reference = logprobs_and_grads(model, rows, None, share=True)
        finally:
            torch.use_deterministic_algorithms(False)
        for _ in range(8):
            _, grads = logprobs_and_grads(model, rows, None, share=True)
            assert all(torch.equal(grads[name], grad) for name, grad in reference.items())
    finally:
        torch.set_num_threads(threads)
