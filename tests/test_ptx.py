"""PTX: the SFT loss (against a loop reference and by hand), the pairs it reads, their tokens, the order of
its batches per (seed, step, rank), and its place in the update (train_on_batch)."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from algorithm_references import ref_sft_loss
from step_helpers import RecordingLearner, random_batch, settings_with

from grpo.algorithm import sft_loss
from grpo.data import DataError, build_prompt_messages, load_sft_pairs, render_prompt
from grpo.data.sft_tokens import TokenizedPair, tokenize_pairs
from grpo.models.tiny import build_qwen2
from grpo.rewards import extract_answer, is_well_formatted
from grpo.step.policy_update import train_on_batch
from grpo.step.ptx import PtxData, collate, ptx_nll
from grpo.parallel.distributed import DistInfo

PAIRS = Path(__file__).parent / "data" / "ptx_pairs.jsonl"
SYSTEM = "Answer briefly."


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the loss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_sft_loss_matches_the_loop_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    B, L = 2 + seed, 3 + 2 * seed
    logp = -torch.rand(B, L, generator=gen, dtype=torch.float64) * 5
    mask = (torch.rand(B, L, generator=gen) < 0.6).long()
    want = ref_sft_loss(logp.tolist(), mask.tolist())
    assert sft_loss(logp, mask).item() == pytest.approx(want, abs=1e-12)


def test_sft_loss_by_hand():
    # Kept tokens have p = 1/2, 1/4 and 1/8: NLLs ln 2, 2 ln 2 and 3 ln 2, mean 2 ln 2. The -9s are
    # prompt and padding positions: masked, they must not count, whatever their value.
    logp = torch.tensor([[math.log(1 / 2), math.log(1 / 4), -9.0], [math.log(1 / 8), -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert sft_loss(logp, mask).item() == pytest.approx(2 * math.log(2), abs=1e-6)
    assert sft_loss(logp, torch.zeros_like(mask)).item() == 0.0  # nothing to learn: 0, not 0/0


def test_ptx_nll_is_the_causal_lm_loss_on_the_response_tokens(tiny_tokenizer):
    # Each pair alone, unpadded, through HF's own loss (labels -100 on the prompt): the NLL summed over
    # responses and divided by their tokens must equal ptx_nll of the padded batch (left-padded prompts,
    # right-padded responses of different lengths).
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=2, seed=0)
    rows = [TokenizedPair([5, 6, 7, 8], [9, 10, 2], "a:1"), TokenizedPair([11, 12], [13, 2], "a:2"),
            TokenizedPair([14, 15, 16], [17, 18, 19, 20, 2], "a:3")]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.prompt_ids + row.response_ids])
            labels = torch.tensor([[-100] * len(row.prompt_ids) + row.response_ids])
            n = len(row.response_ids)
            total += model(input_ids=ids, labels=labels).loss.item() * n
            count += n
        got = ptx_nll(model, collate(rows, pad_id=tiny_tokenizer.pad_token_id)).item()
    assert got == pytest.approx(total / count, abs=1e-5)


def test_only_response_tokens_carry_the_loss(tiny_tokenizer):
    # Padding ids never reach the loss, and the gradient flows from response tokens only: a batch whose
    # padding holds other ids gives the same loss.
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    batch = collate([TokenizedPair([5, 6], [9, 10, 2], "a:1"), TokenizedPair([7, 8, 9, 10], [11, 2], "a:2")], pad_id=0)
    other = collate([TokenizedPair([5, 6], [9, 10, 2], "a:1"), TokenizedPair([7, 8, 9, 10], [11, 2], "a:2")], pad_id=3)
    assert batch.prompt_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    with torch.no_grad():
        assert ptx_nll(model, batch).item() == pytest.approx(ptx_nll(model, other).item(), abs=1e-6)


# --- the pairs --------------------------------------------------------------------------------------


def test_gsm8k_files_give_pairs_and_the_gsm8k_format_writes_the_run_tags():
    plain = load_sft_pairs(PAIRS)
    assert len(plain) == 32 and plain[0].source.endswith("ptx_pairs.jsonl:1")
    assert plain[0].prompt.messages[-1]["role"] == "user" and "####" in plain[0].response
    tagged = load_sft_pairs(PAIRS, response_format="gsm8k", tag_style="reasoning")
    gold = plain[0].response.rsplit("####", 1)[1].strip()
    assert is_well_formatted(tagged[0].response, "reasoning")
    assert extract_answer(tagged[0].response, "reasoning") == gold
    assert "####" not in tagged[0].response and tagged[0].prompt == plain[0].prompt


def test_chat_messages_and_paddle_src_tgt_rows(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?", "name": "x"}, {"role": "assistant", "content": "4"}]}])
    [pair] = load_sft_pairs(chat, prompt_column="messages")
    assert pair.response == "4" and [m["content"] for m in pair.prompt.messages] == ["hi", "hello", "2+2?"]
    assert pair.prompt.messages[-1] == {"role": "user", "content": "2+2?"}  # extra keys dropped
    paddle = write_jsonl(tmp_path / "paddle.jsonl", [{"src": ["hi", "2+2?"], "tgt": ["hello", "4"]},
                                                     {"src": "3+3?", "tgt": "6"}])
    multi, single = load_sft_pairs(paddle, prompt_column="src", response_column="tgt")
    assert multi.prompt.messages == pair.prompt.messages and multi.response == "4"
    assert single.prompt.messages == [{"role": "user", "content": "3+3?"}] and single.response == "6"


@pytest.mark.parametrize("rows,kwargs,message", [
    ([{"question": "a", "answer": "b"}, {"question": "c"}], {}, "bad.jsonl:2: missing key 'answer'"),
    ([{"question": "a", "answer": "  "}], {}, "bad.jsonl:1: the response"),
    ([{"question": "a", "answer": "no marker"}], {"response_format": "gsm8k"}, "bad.jsonl:1: GSM8K answer has no"),
    ([{"messages": [{"role": "assistant", "content": "x"}]}], {"prompt_column": "messages"},
     "bad.jsonl:1: column 'messages' without its final assistant turn"),
    ([{"src": ["a", "b"], "tgt": "x"}], {"prompt_column": "src", "response_column": "tgt"},
     "bad.jsonl:1: src/tgt lengths do not match"),
])
def test_a_bad_row_is_an_error_naming_file_and_line(tmp_path, rows, kwargs, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as info:
        load_sft_pairs(path, **kwargs)
    assert message in str(info.value)


def test_tokens_are_the_rl_prompt_then_the_response_and_eos(tiny_tokenizer):
    pairs = load_sft_pairs(PAIRS)[:3]
    tokenized = tokenize_pairs(tiny_tokenizer, pairs, SYSTEM, max_length=10_000)
    row = tokenized.rows[0]
    rl_prompt = render_prompt(tiny_tokenizer, build_prompt_messages(pairs[0].prompt, SYSTEM))  # as make_experience
    assert row.prompt_ids == tiny_tokenizer(rl_prompt, add_special_tokens=False)["input_ids"]
    assert row.response_ids[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(row.response_ids[:-1]) == pairs[0].response
    assert (tokenized.cut, tokenized.dropped) == (0, 0)


def test_long_pairs_are_cut_or_left_out_and_counted(tiny_tokenizer):
    pairs = load_sft_pairs(PAIRS)[:3]
    full = tokenize_pairs(tiny_tokenizer, pairs, SYSTEM, max_length=10_000).rows
    prompts = sorted(len(r.prompt_ids) for r in full)
    limit = prompts[1] + 2  # the shortest prompts fit with 2+ response tokens, the longest does not fit at all
    assert prompts[2] >= limit
    short = tokenize_pairs(tiny_tokenizer, pairs, SYSTEM, max_length=limit)
    assert short.dropped == 1 and short.cut == 2 and len(short.rows) == 2
    for row in short.rows:
        assert len(row.prompt_ids) + len(row.response_ids) == limit  # the end (and the EOS) cut off
        assert row.response_ids[-1] != tiny_tokenizer.eos_token_id
    with pytest.raises(DataError, match="ptx_pairs.jsonl:1: the prompt alone is"):
        tokenize_pairs(tiny_tokenizer, pairs, SYSTEM, max_length=prompts[0])


# --- which pairs a step trains on ---------------------------------------------------------------------


def test_batches_are_a_function_of_seed_step_and_rank():
    rows = [TokenizedPair([1], [2], f"f:{i}") for i in range(10)]

    def data(seed=3):
        return PtxData(rows, micro_batch_size=2, world_size=2, seed=seed, pad_id=0)

    a, b = data(), data()  # b: a fresh process, as after resuming
    assert [b.indices(s, r) for s in (4, 1, 7) for r in (1, 0)] == [a.indices(s, r) for s in (4, 1, 7) for r in (1, 0)]
    for step in (1, 2):  # ranks of a step take different pairs; an epoch (10 pairs, 4 per step) repeats none
        assert not set(a.indices(step, 0)) & set(a.indices(step, 1))
    assert len({i for s in (1, 2) for r in (0, 1) for i in a.indices(s, r)}) == 8
    assert [data(seed=4).indices(s, 0) for s in (1, 2, 3)] != [a.indices(s, 0) for s in (1, 2, 3)]
    batch = a.batch(1, 1)
    assert batch.sources == [f"f:{i}" for i in a.indices(1, 1)]


# --- the update ---------------------------------------------------------------------------------------


class SyncRecordingLearner(RecordingLearner):
    """Also records the ``last`` flag of every backward's accumulation window (where DDP would sync)."""

    def __init__(self, module):
        super().__init__(module)
        self.lasts = []

    def accumulating(self, last):
        self.lasts.append(last)
        return nullcontext()


def ptx_batch() -> object:
    return collate([TokenizedPair([5, 6, 7], [8, 9, 2], "p:1"), TokenizedPair([10, 11], [12, 2], "p:2")], pad_id=0)


def test_each_update_adds_coef_times_the_ptx_gradient_before_it_syncs(tiny_tokenizer):
    batch, ptx = random_batch(len(tiny_tokenizer)), ptx_batch()
    grads = {}
    for name, extra in (("rl", {}), ("both", {"ptx": ptx})):
        model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
        learner = SyncRecordingLearner(model)
        stats = train_on_batch(learner, batch, settings_with(num_iterations=2, ptx_coef=0.3), DistInfo(), **extra).totals
        grads[name] = learner.grads
        if name == "both":
            # 3 policy micro-batches per update, then the PTX one: only its backward may sync (DDP).
            assert learner.lasts == [False, False, False, True] * 2
            assert stats["skipped_updates"] == 0.0
            with torch.no_grad():
                assert stats["loss/ptx"] == pytest.approx(ptx_nll(model, ptx).item(), abs=1e-6)
        else:
            assert learner.lasts == [False, False, True] * 2 and "loss/ptx" not in stats
    model = build_qwen2(tiny_tokenizer, hidden_size=32, num_layers=1, seed=0)
    ptx_nll(model, ptx).backward()
    for update in range(2):  # the recording learner does not step: both updates see the same weights
        for name, grad in grads["both"][update].items():
            want = grads["rl"][update][name] + 0.3 * dict(model.named_parameters())[name].grad
            assert torch.allclose(grad, want, atol=1e-6, rtol=1e-5), (update, name)
