"""Weights published one tensor at a time (``grpo.weight_store.streamed``, FSDP2's gathered tensors): the file is a
safetensors file equal to ``save_file``'s tensors whatever their dtypes and shapes, the version verifies and
loads like any other, and a stream that disagrees with its layout fails before any version appears."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from grpo.weight_store import WeightStore
from grpo.weight_store.streamed import TensorStream


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(7, 3, generator=gen).to(torch.bfloat16),
            "model.norm.weight": torch.randn(3, generator=gen),  # 12 bytes: the next one is not 8-aligned
            "count": torch.tensor(5, dtype=torch.int64),  # 0-dim
            "empty": torch.zeros(0, 4),
            "mask": torch.tensor([True, False, True]),
            "head.weight": torch.randn(2, 5, generator=gen, dtype=torch.float64)}


def stream_of(state: dict[str, torch.Tensor], order=None) -> TensorStream:
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    names = order or list(state)
    return TensorStream(layout, ((name, state[name]) for name in names))


def test_a_streamed_version_loads_as_the_tensors_themselves(tmp_path):
    store, state = WeightStore(tmp_path), tensors()
    folder = store.publish(3, stream_of(state), kind="full", keep=2)
    read = safetensors.torch.load_file(folder / "model.safetensors")  # the library's own reader accepts it
    loaded = store.load(3)  # sizes and hashes against the manifest
    for name, tensor in state.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert (loaded.version, loaded.kind) == (3, "full")


@pytest.mark.parametrize("order, message", [
    (["model.norm.weight", "model.embed_tokens.weight"], "does not match the layout's next entry"),
    (["model.embed_tokens.weight"], "the stream ended before 5 tensors"),
])
def test_a_stream_that_disagrees_with_its_layout_leaves_no_version(tmp_path, order, message):
    store = WeightStore(tmp_path)
    store.publish(1, tensors(), kind="full")
    with pytest.raises(ValueError, match=message):
        store.publish(2, stream_of(tensors(), order), kind="full")
    assert store.versions() == [1] and not list((tmp_path / "weights").glob(".tmp-*"))
