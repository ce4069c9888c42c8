"""grpo.decoupled.wire: exact round trips of every message and of rollout batches; every rejection; fuzzing shows that
decode / message_to_batch / unpack_bytes raise WireError and nothing else, whatever bytes arrive."""

from __future__ import annotations

import json
import re
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo.decoupled.wire import (
    KINDS,
    MAX_PACKED_FRAMES,
    PROTOCOL_VERSION,
    WireError,
    batch_to_message,
    decode,
    encode,
    message_to_batch,
    pack_bytes,
    unpack_bytes,
)
from grpo.rollout.generation import Generation
from grpo.step.records import RolloutBatch

MAX = 1 << 20
META = {"batch_id": "s0:0:7", "sampler_id": "s0", "policy_version": 3, "step": 12, "seed": [1, 2], "note": None}


def make_batch(N: int = 6, G: int = 2, Lp: int = 5, Lc: int = 7, F: int = 2, logprobs: bool = True,
               seed: int = 0, sampler_logprobs: bool = False) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    completion_mask = (torch.arange(Lc)[None] < torch.randint(1, Lc + 1, (N,), generator=gen)[:, None]).long()
    prompt_mask = torch.ones(N, Lp, dtype=torch.long)
    prompt_mask[:1, :2] = 0
    reward_parts = torch.randn(N, F, generator=gen)
    reward_parts[1:2, :1] = float("nan")  # an abstaining reward function must survive the trip
    logp = -torch.rand(N, Lc, generator=gen)
    return RolloutBatch(
        generation=Generation(
            prompt_ids=torch.randint(0, 1000, (N, Lp), generator=gen), prompt_mask=prompt_mask,
            completion_ids=torch.randint(0, 1000, (N, Lc), generator=gen), completion_mask=completion_mask,
            truncated=torch.arange(N) % 3 == 0, completions=[f"<think>é {i}</think><answer>{i}</answer>" for i in range(N)]),
        rewards=torch.randn(N, generator=gen), reward_parts=reward_parts, reward_names=[f"r{f}" for f in range(F)],
        advantages=torch.randn(N, generator=gen), old_logprobs=logp - 0.1 if logprobs else None,
        ref_logprobs=logp + 0.2 if logprobs else None, prompts=[f"prompt {p} ✓" for p in range(N // G)],
        columns={"answer": [str(i // G) for i in range(N)], "question": [[{"role": "user", "content": "q"}]] * N},
        reward_metrics={"judge/latency_s": 0.25}, reward_extras={"gold_parsed": [f"[{i}]" for i in range(N)]},
        sampler_logprobs=(logp - 0.3) * completion_mask if sampler_logprobs else None)


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        x, y = getattr(a.generation, name), getattr(b.generation, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("rewards", "advantages", "old_logprobs", "ref_logprobs", "sampler_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    # NaN != NaN for torch.equal: compare the NaN pattern and the rest separately.
    assert torch.equal(a.reward_parts.isnan(), b.reward_parts.isnan())
    assert torch.equal(a.reward_parts.nan_to_num(7.0), b.reward_parts.nan_to_num(7.0))
    assert a.generation.completions == b.generation.completions
    assert (a.reward_names, a.prompts, a.columns) == (b.reward_names, b.prompts, b.columns)
    assert (a.reward_metrics, a.reward_extras) == (b.reward_metrics, b.reward_extras)


def batch_frames(token: str = "", **kwargs) -> list[bytes]:
    header, tensors = batch_to_message(make_batch(**kwargs), META)
    return encode("batch", header, tensors, token=token)


def with_header(frames: list[bytes], **changes) -> list[bytes]:
    header = json.loads(frames[1])
    header.update(changes)
    return [frames[0], json.dumps(header).encode(), frames[2]]


# --- round trips ----------------------------------------------------------------------------------

@pytest.mark.parametrize("logprobs", [True, False])
def test_batch_round_trip_is_exact(logprobs):
    batch = make_batch(logprobs=logprobs)
    header, tensors = batch_to_message(batch, META)
    frames = encode("batch", header, tensors, token="sekrit")
    message = decode(frames, token="sekrit", max_bytes=MAX)
    assert message.kind == "batch"
    back, meta = message_to_batch(message)
    assert_same_batch(batch, back)
    assert meta == META
    assert set(message.tensors) >= {"prompt_ids", "advantages"}
    assert ("old_logprobs" in message.tensors) is logprobs


def test_sampler_logprobs_round_trip_exactly():
    # loss.sampler_is_correction in decoupled mode: the sampler's own log-probs travel beside (or, with the
    # correction on, instead of) the old ones, and arrive bit for bit.
    batch = make_batch(sampler_logprobs=True)
    batch.old_logprobs = None
    header, tensors = batch_to_message(batch, META)
    back, _ = message_to_batch(decode(encode("batch", header, tensors), max_bytes=MAX))
    assert_same_batch(batch, back)
    assert back.old_logprobs is None and torch.equal(back.sampler_logprobs, batch.sampler_logprobs)
    wrong = make_batch(sampler_logprobs=True)
    wrong.sampler_logprobs = wrong.sampler_logprobs[:, :3]
    with pytest.raises(WireError, match="sampler_logprobs has shape"):
        batch_to_message(wrong, META)


def test_round_trip_keeps_dtypes_and_survives_pack_bytes():
    batch = make_batch(N=4, G=4, F=1)
    batch.generation.completion_mask = batch.generation.completion_mask.bool()
    batch.generation.prompt_ids = batch.generation.prompt_ids.int()
    batch.advantages = batch.advantages.to(torch.bfloat16)
    batch.old_logprobs = batch.old_logprobs.double()
    header, tensors = batch_to_message(batch, META)
    frames = unpack_bytes(pack_bytes(encode("batch", header, tensors)))
    back, _ = message_to_batch(decode(frames, max_bytes=MAX))
    assert_same_batch(batch, back)


def test_non_contiguous_and_shared_tensors_are_sent_as_values():
    batch = make_batch(N=4, G=2, Lc=3)
    batch.old_logprobs = torch.randn(3, 4).t()  # a transposed view: [N=4, Lc=3], not contiguous
    shared = torch.randn(2, 4)
    batch.rewards, batch.advantages = shared[0], shared[1]  # two views of one storage
    header, tensors = batch_to_message(batch, META)
    back, _ = message_to_batch(decode(encode("batch", header, tensors), max_bytes=MAX))
    assert_same_batch(batch, back)


def test_empty_batch_round_trips():
    batch = make_batch(N=0, G=1, Lc=3)
    back, _ = message_to_batch(decode(encode("batch", *batch_to_message(batch, META)), max_bytes=MAX))
    assert back.generation.completion_ids.shape == (0, 3) and back.prompts == []


CONTROL_HEADERS = {
    "hello": {"sampler_id": "s0", "incarnation": 2},
    "welcome": {"policy_version": 4, "trained_count": 3, "pending_count": 1, "protocol": PROTOCOL_VERSION,
                "trainer_id": "ab12", "max_message_bytes": 1 << 20, "weights_path": None},
    "ack": {"batch_id": "b", "policy_version": 5, "weights_version": 4, "weights_path": "/w/v4"},
    "dropped": {"batch_id": "b", "reason": "stale", "policy_version": 5},
    "busy": {"batch_id": "b", "queue_depth": 4},
    "weights": {"version": 6, "path": "/w/v6"},
    "want": {},
    "work": {"batch_id": "step-3/rank-1", "step": 3, "rank": 1, "min_version": 2, "adopt": ["step-1/rank-0#2"]},
    "heartbeat": {"time": 1.5},
    "bye": {"reason": "done"},
    "error": {"reason": "bad", "code": "bad_message", "batch_id": None},
}


def test_every_kind_is_covered_by_a_round_trip():
    assert set(CONTROL_HEADERS) | {"batch"} == set(KINDS)


@pytest.mark.parametrize("kind", sorted(CONTROL_HEADERS))
def test_control_message_round_trip(kind):
    frames = encode(kind, CONTROL_HEADERS[kind], token="t")
    assert frames[2] == b""
    message = decode(frames, token="t", max_bytes=MAX)
    assert (message.kind, message.header, message.tensors) == (kind, CONTROL_HEADERS[kind], {})


# --- rejections -----------------------------------------------------------------------------------

def _payload_with_dtype(dtype) -> bytes:
    return safetensors.torch.save({"prompt_ids": torch.zeros(2, dtype=dtype)})


REJECTIONS = {
    "two frames": (lambda f: f[:2], "3 frames"),
    "four frames": (lambda f: [*f, b""], "3 frames"),
    "not bytes": (lambda f: [f[0], f[1], 7], "not bytes"),
    "not a list": (lambda f: b"".join(f), "list of frames"),
    "wrong token": (lambda f: [b"guess", f[1], f[2]], "token mismatch"),
    "no token": (lambda f: [b"", f[1], f[2]], "token mismatch"),
    "bad json": (lambda f: [f[0], b"{not json", f[2]], "not valid JSON"),
    "bad utf-8": (lambda f: [f[0], b"\xff\xfe{}", f[2]], "not valid JSON"),
    "json array": (lambda f: [f[0], b"[1, 2]", f[2]], "must be a JSON object"),
    "NaN in header": (lambda f: [f[0], f[1].replace(b'"policy_version":3', b'"policy_version":NaN'), f[2]],
                      "not valid JSON"),
    "duplicate key": (lambda f: [f[0], f[1][:-1] + b',"kind":"hello"}', f[2]], "duplicate key"),
    "deep nesting": (lambda f: [f[0], b"[" * 100_000 + b"]" * 100_000, f[2]], "not valid JSON"),
    "wrong version": (lambda f: with_header(f, v=PROTOCOL_VERSION + 1), f"protocol version {PROTOCOL_VERSION + 1}"),
    "version as string": (lambda f: with_header(f, v="1"), "integer protocol version"),
    "unknown kind": (lambda f: with_header(f, kind="gimme"), "unknown message kind 'gimme'; known: ack, batch"),
    "missing field": (lambda f: {**dict(enumerate(f)), 1: json.dumps(
        {k: v for k, v in json.loads(f[1]).items() if k != "batch_id"}).encode()}.values(), "field 'batch_id'"),
    "wrong field type": (lambda f: with_header(f, policy_version="3"), "'policy_version' must be int"),
    "bool is not int": (lambda f: with_header(f, policy_version=True), "'policy_version' must be int"),
    "list of non-str": (lambda f: with_header(f, prompts=[1, 2, 3]), "'prompts' must be list[str]"),
    "bad safetensors": (lambda f: [f[0], f[1], b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"], "not valid safetensors"),
    "truncated safetensors": (lambda f: [f[0], f[1], f[2][:-3]], "not valid safetensors"),
    "complex tensor": (lambda f: [f[0], f[1], _payload_with_dtype(torch.complex64)], "does not carry"),
    "float8 tensor": (lambda f: [f[0], f[1], _payload_with_dtype(torch.float8_e4m3fn)], "does not carry"),
    "payload on hello": (lambda f: [f[0], encode("hello", CONTROL_HEADERS["hello"])[1], f[2]], "carry no tensors"),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_decode_rejects(case):
    mutate, expected = REJECTIONS[case]
    frames = batch_frames(token="tok")
    mutated = mutate(frames)
    mutated = list(mutated) if not isinstance(mutated, bytes) else mutated
    with pytest.raises(WireError, match=None) as info:
        decode(mutated, token="tok", max_bytes=8 * MAX)
    assert expected in str(info.value), str(info.value)


def test_size_limits_are_checked_before_parsing():
    frames = batch_frames()
    total = sum(map(len, frames))
    assert decode(frames, max_bytes=total).kind == "batch"
    with pytest.raises(WireError, match=f"message of {total} bytes exceeds the limit of {total - 1} bytes"):
        decode(frames, max_bytes=total - 1)
    # An oversized header is refused without being parsed (it is not even JSON here).
    with pytest.raises(WireError, match="header of 2001 bytes exceeds the limit of 2000"):
        decode([b"", b"x" * 2001, b""], max_bytes=MAX, max_header_bytes=2000)


def test_rejections_after_authentication_carry_the_header():
    frames = with_header(batch_frames(), completions=["only one"])
    with pytest.raises(WireError, match="1 completion texts for N=6") as info:
        message_to_batch(decode(frames, max_bytes=MAX))
    assert info.value.header["batch_id"] == META["batch_id"]
    with pytest.raises(WireError, match="token mismatch") as info:
        decode(frames, token="x", max_bytes=MAX)
    assert info.value.header is None  # nothing from an unauthenticated message is trusted


def _tensors_with(**changes) -> dict:
    _, tensors = batch_to_message(make_batch(), META)
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


SHAPE_REJECTIONS = {
    "Lc differs": ({"completion_mask": torch.ones(6, 8, dtype=torch.long)}, {}, "Lc is 8 here but 7"),
    "N differs": ({"rewards": torch.zeros(5)}, {}, "N is 5 here but 6"),
    "F differs": ({"reward_parts": torch.zeros(6, 3)}, {}, "F is 3 here but 2"),
    "Lp differs": ({"prompt_mask": torch.ones(6, 4, dtype=torch.long)}, {}, "Lp is 4 here but 5"),
    "logprobs Lc": ({"ref_logprobs": torch.zeros(6, 6)}, {}, "Lc is 6 here but 7"),
    "wrong rank": ({"advantages": torch.zeros(6, 1)}, {}, "must be [N], got shape [6, 1]"),
    "missing tensor": ({"advantages": None}, {}, "missing tensors ['advantages']"),
    "unknown tensor": ({"values": torch.zeros(6)}, {}, "unknown tensors ['values']"),
    "truncated not bool": ({"truncated": torch.zeros(6, dtype=torch.long)}, {}, "truncated must be bool"),
    "ids are float": ({"prompt_ids": torch.zeros(6, 5)}, {}, "prompt_ids must be integer"),
    "rewards are int": ({"rewards": torch.zeros(6, dtype=torch.long)}, {}, "rewards must be floating"),
    "too few completions": ({}, {"completions": ["a"] * 5}, "5 completion texts for N=6"),
    "prompts do not divide N": ({}, {"prompts": ["a"] * 4}, "4 prompts for N=6"),
    "no prompts": ({}, {"prompts": []}, "0 prompts for N=6"),
    "column length": ({}, {"columns": {"answer": ["1"] * 5}}, "column 'answer' must be a list of N=6 values, got 5"),
    "column not a list": ({}, {"columns": {"answer": "1"}}, "got str"),
    "reward extra length": ({}, {"reward_extras": {"x": [1] * 5}}, "reward_extras['x'] must be a list of N=6"),
    "reward metric not a number": ({}, {"reward_metrics": {"m": "1"}}, "reward_metrics['m'] must be a number"),
}


@pytest.mark.parametrize("case", sorted(SHAPE_REJECTIONS))
def test_message_to_batch_rejects_inconsistent_batches(case):
    tensor_changes, header_changes, expected = SHAPE_REJECTIONS[case]
    header, _ = batch_to_message(make_batch(), META)
    header.update(header_changes)
    frames = encode("batch", header, _tensors_with(**tensor_changes))
    with pytest.raises(WireError) as info:
        message_to_batch(decode(frames, max_bytes=MAX))
    assert expected in str(info.value), str(info.value)


def test_batch_to_message_checks_before_sending():
    batch = make_batch()
    for meta, expected in [({**META, "policy_version": "3"}, "'policy_version' (int)"),
                           ({k: v for k, v in META.items() if k != "batch_id"}, "'batch_id' (str)"),
                           ({**META, 4: "x"}, "meta keys must be strings")]:
        with pytest.raises(WireError, match=re.escape(expected)):
            batch_to_message(batch, meta)
    batch.generation.completions = batch.generation.completions[:-1]
    with pytest.raises(WireError, match="5 completion texts for N=6"):
        batch_to_message(batch, META)


def test_encode_refuses_what_decode_would_refuse():
    with pytest.raises(WireError, match="unknown message kind"):
        encode("nope", {})
    with pytest.raises(WireError, match="missing the field 'incarnation'"):
        encode("hello", {"sampler_id": "s"})
    with pytest.raises(WireError, match="reserved"):
        encode("bye", {"v": 2})
    with pytest.raises(WireError, match="not strict JSON"):
        encode("bye", {"reason": "x", "extra": float("nan")})
    with pytest.raises(WireError, match="not strict JSON"):
        encode("bye", {"reason": "x", "extra": object()})
    with pytest.raises(WireError, match="carry no tensors"):
        encode("bye", {}, {"x": torch.zeros(1)})
    with pytest.raises(WireError, match="does not carry"):
        header, tensors = batch_to_message(make_batch(), META)
        encode("batch", header, {**tensors, "rewards": torch.zeros(6, dtype=torch.complex64)})


# --- pack_bytes -------------------------------------------------------------------------------------

def test_pack_bytes_round_trip():
    for frames in ([], [b""], [b"a", b"", b"xyz" * 1000], batch_frames(token="t")):
        assert unpack_bytes(pack_bytes(frames)) == frames
    assert unpack_bytes(bytearray(pack_bytes([b"q"]))) == [b"q"]


@pytest.mark.parametrize("data, expected", [
    (b"GRP", "shorter than its 9-byte prefix"),
    (b"XXXX\x01\x00\x00\x00\x00", "starts with b'XXXX'"),
    (b"GRPW\x02\x00\x00\x00\x00", "format 2"),
    (b"GRPW\x01" + struct.pack("<I", 10**9), f"at most {MAX_PACKED_FRAMES}"),
    (b"GRPW\x01" + struct.pack("<I", 2) + struct.pack("<Q", 1), "too short for 2 frame lengths"),
    (pack_bytes([b"abc"])[:-1], "add up to 3 bytes but 2 follow"),
    (pack_bytes([b"abc"]) + b"!", "add up to 3 bytes but 4 follow"),
    (b"GRPW\x01" + struct.pack("<I", 1) + struct.pack("<Q", 2**64 - 1) + b"a", "add up to"),
    ("text", "must be bytes"),
])
def test_unpack_bytes_rejects(data, expected):
    with pytest.raises(WireError) as info:
        unpack_bytes(data)
    assert expected in str(info.value), str(info.value)


# --- fuzzing: only WireError ever escapes ------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = batch_frames(token="tok", N=4, G=2, Lp=3, Lc=4, F=1)
VALID_PACKED = pack_bytes(VALID)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


def decode_only_raises_wire_error(frames) -> None:
    try:
        message = decode(frames, token="tok", max_bytes=MAX)
        if message.kind == "batch":
            message_to_batch(message)
    except WireError:
        pass


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_fuzz_decode_arbitrary_frames(frames):
    decode_only_raises_wire_error(frames)
    decode_only_raises_wire_error([b"tok", *frames[:2]])


@FUZZ
@given(st.integers(0, 2), st.data())
def test_fuzz_decode_mutated_batch(frame_index, data):
    frames = list(VALID)
    frame = bytearray(frames[frame_index])
    for _ in range(data.draw(st.integers(1, 4))):
        if not frame:
            break
        position = data.draw(st.integers(0, len(frame) - 1))
        if data.draw(st.booleans()):
            frame[position] = data.draw(st.integers(0, 255))
        else:
            del frame[position:position + data.draw(st.integers(1, 16))]
    frames[frame_index] = bytes(frame)
    decode_only_raises_wire_error(frames)


@FUZZ
@given(st.sampled_from(sorted(KINDS)), st.dictionaries(st.text(max_size=12), json_values, max_size=6),
       st.binary(max_size=64))
def test_fuzz_decode_random_headers(kind, fields, payload):
    header = json.dumps({"v": PROTOCOL_VERSION, "kind": kind, **fields}).encode()
    decode_only_raises_wire_error([b"tok", header, payload])
    decode_only_raises_wire_error([b"tok", header, VALID[2]])


@FUZZ
@given(st.sampled_from(sorted(json.loads(VALID[1]))), json_values)
def test_fuzz_batch_header_fields(key, value):
    decode_only_raises_wire_error(with_header(VALID, **{key: value}))


@FUZZ
@given(st.binary(max_size=128))
def test_fuzz_unpack_bytes_arbitrary(data):
    try:
        unpack_bytes(data)
        unpack_bytes(b"GRPW\x01" + data)
    except WireError:
        pass


@FUZZ
@given(st.integers(0, len(VALID_PACKED) - 1), st.integers(0, 255), st.integers(0, 32))
def test_fuzz_unpack_bytes_mutated(position, value, cut):
    data = bytearray(VALID_PACKED)
    data[position] = value
    try:
        frames = unpack_bytes(bytes(data[:len(data) - cut]))
        decode_only_raises_wire_error(frames)
    except WireError:
        pass
