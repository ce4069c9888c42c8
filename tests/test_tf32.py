"""model.tf32: TF32 matmuls for the run on a TF32 GPU (as transformers' enable_tf32 sets them), refused elsewhere
with transformers' reason; null leaves torch's setting alone."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.models.loading import compute_context
from grpo.models.precision import TF32_UNAVAILABLE, check_precision, tf32_available, tf32_mode

CPU = torch.device("cpu")


def test_tf32_true_is_refused_on_a_cpu_with_transformers_reason():
    with pytest.raises(ConfigError, match="model.tf32 is true but train.device is cpu"):
        load_config(None, ["model.tf32=true", "train.device=cpu"])
    cfg = load_config(None, ["model.tf32=true"]).model  # train.device auto: checked where the device is known
    with pytest.raises(ConfigError, match=r"model.tf32: --tf32 requires Ampere or a newer GPU arch.*on cpu"):
        check_precision(cfg, CPU)
    check_precision(load_config(None, ["model.tf32=false"]).model, CPU)  # off: nothing to refuse
    assert TF32_UNAVAILABLE.startswith("--tf32 requires Ampere")


def test_the_mode_is_set_for_the_block_and_put_back():
    before = torch.backends.fp32_precision
    with tf32_mode(True):
        assert torch.backends.fp32_precision == "tf32"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # cuBLAS and cuDNN inherit it
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert torch.backends.fp32_precision == before
    with tf32_mode(False):
        assert torch.backends.fp32_precision == "ieee"
    with tf32_mode(None):
        assert torch.backends.fp32_precision == before


def test_the_runs_compute_context_carries_the_mode():
    # (the device check refuses true on a CPU run before this context is built; the context itself is device-free)
    before = torch.backends.fp32_precision
    for setting, inside in (("false", "ieee"), ("true", "tf32"), ("null", before)):
        with compute_context(load_config(None, [f"model.tf32={setting}"]).model, CPU, False):
            assert torch.backends.fp32_precision == inside, setting
        assert torch.backends.fp32_precision == before


@pytest.mark.gpu
@pytest.mark.skipif(not tf32_available(), reason="needs an Ampere or newer CUDA GPU")
def test_tf32_runs_matmuls_in_tf32_on_an_ampere_gpu():
    cfg = load_config(None, ["model.tf32=true"]).model
    device = torch.device("cuda")
    check_precision(cfg, device)
    a = torch.randn(512, 512, device=device)
    exact = (a.double() @ a.double()).float()
    ieee = (a @ a - exact).abs().max()
    with compute_context(cfg, device, False):
        tf32 = (a @ a - exact).abs().max()
    assert tf32 > 10 * ieee  # TF32 keeps 10 mantissa bits: its error is far above fp32's
