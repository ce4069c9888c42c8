"""Build small Qwen2-architecture models (and Qwen3-MoE ones) and their tokenizers in-process, with no hub access.

Used by the tests (random tiny models) and by the script that builds the shipped default model.
The tokenizer is byte-level BPE like Qwen's, with digits split one per token (so arithmetic is
learnable by a tiny model), Qwen's special tokens and a Qwen-style chat template.
"""

from __future__ import annotations

from typing import Iterable

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

# The Qwen2.5 chat format: <|im_start|>role\ncontent<|im_end|>\n ..., generation prompt "<|im_start|>assistant\n".
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "<reasoning>", "</reasoning>"]

DEFAULT_CORPUS = [
    "Tom has 12 apples and buys 7 more. How many apples does he have now?",
    "<think>\n12 + 7 = 19\n</think>\n<answer>\n19\n</answer>",
    "A train travels 60 miles per hour for 3 hours. How far does it go? 60 * 3 = 180",
    "Respond in the following format: think step by step, then give the final number.",
    "Sara spent $1,080 on 4 chairs. What did each chair cost? 1080 / 4 = 270 dollars",
    "The quick brown fox jumps over the lazy dog. Hello world, what is the answer?",
]


def build_tokenizer(corpus: Iterable[str] = DEFAULT_CORPUS, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on ``corpus`` and wrap it as a HF fast tokenizer.

    Returns a ``PreTrainedTokenizerFast`` with ``eos_token = "<|im_end|>"`` (the end of an assistant
    turn, as Qwen2.5-Instruct), ``pad_token = "<|endoftext|>"``, left padding (for batched generation)
    and the Qwen chat template. Deterministic for a given corpus and vocab size.
    """
    tok = Tokenizer(models.BPE())
    # Digits one per token before byte-level splitting: "1080" -> 1 0 8 0.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    # The answer tags are single tokens but NOT special: decode(skip_special_tokens=True), which turns
    # completions into the text rewards read, must keep them.
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = QWEN_CHAT_TEMPLATE
    return wrapped


def build_qwen2(
    tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    vocab_size: int | None = None,
    rope_theta: float = 10000.0,
    seed: int = 0,
):
    """A randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` (same code path as Qwen2.5).

    ``vocab_size``: rows of the embedding and output head; None = ``len(tokenizer)``. A larger one gives
    a real model's shape with a small tokenizer (Qwen2.5's 151936 rows are more than its tokenizer's
    151665 tokens too). ``rope_theta``: Qwen2.5 uses 1e6. ``seed`` makes the initial weights
    reproducible without touching the global RNG's later use.
    """
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")

    config = Qwen2Config(
        vocab_size=len(tokenizer) if vocab_size is None else vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _seeded(Qwen2ForCausalLM, config, tokenizer, seed)


def build_qwen3_moe(tokenizer, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                    moe_intermediate_size: int, num_experts: int, top_k: int, vocab_size: int,
                    tie_word_embeddings: bool = True, max_position_embeddings: int = 32768, seed: int = 0):
    """A randomly initialised ``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B's make at any size): every layer sparse,
    ``top_k`` of ``num_experts`` experts a token with their weights renormalised, q/k norms, head_dim
    hidden / heads, rope theta 1e6, Qwen3's router aux-loss coefficient."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads, intermediate_size=4 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.001,
        max_position_embeddings=max_position_embeddings, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=tie_word_embeddings, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return _seeded(Qwen3MoeForCausalLM, config, tokenizer, seed)


def _seeded(model_class, config, tokenizer, seed: int):
    """``model_class(config)`` initialised from ``seed`` without touching the global RNG's later use, generating
    until the tokenizer's EOS."""
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
