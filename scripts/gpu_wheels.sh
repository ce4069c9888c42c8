#!/usr/bin/env bash
# Stage what `make bench-gpu` (benchmarks/gpu_vs_trl.py) needs on the lent GPU machine and that it lacks,
# in .whl/ (gitignored): wheels for Python 3.12 on x86-64 Linux, and a copy of GSM8K's train.jsonl.
#
#   bash scripts/gpu_wheels.sh        # here, with network; GRPO_GSM8K_DIR=... if ../shared is elsewhere
#
# The GPU machine has no network. It has torch 2.11.0+cu130, transformers 5.17, peft, accelerate 1.15,
# safetensors, tokenizers, huggingface_hub, pandas, pyarrow, sympy, rich, tensorboard, matplotlib and
# pytest, but not trl, datasets, pyzmq or math-verify (/work/.library/device/KINDS.md; the H100 notes).
# The device call carries `.whl` (64 MiB at most with the working tree, so this checks it stays under
# 55 MiB) and runs, in the repository root there:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:src python3 benchmarks/gpu_vs_trl.py --gsm8k .whl/gsm8k \
#          --cases full,full-gc --out $OUT/gpu_vs_trl-a.json
#
# (one command may run 10 minutes: two calls of two cases each; `--merge` joins the two files here).
# --no-deps: every package named below is pinned here, and nothing else is fetched; /tmp/site comes
# first on PYTHONPATH, so these versions win over the machine's own (transformers 5.23 over 5.17).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"
GSM8K="${GRPO_GSM8K_DIR:-$ROOT/../shared/data/gsm8k}"
LIMIT_MIB=55

# name==version, and why each is needed there
WHEELS=(
  trl==1.16.0                    # the other side of the benchmark (the `bench` extra's pin)
  transformers==5.23.0           # grpo pins 5.23; the machine has 5.17
  peft==0.21.2                   # grpo's pin (LoRA on both sides); the machine's version is not pinned
  datasets==5.2.0                # TRL imports it, and the TRL runner builds its Dataset with it
  dill==0.4.1                    # datasets
  multiprocess==0.70.19          # datasets
  math-verify==0.9.0             # grpo's answer_correct reward (both sides use it)
  latex2sympy2_extended==1.11.0  # math-verify
  antlr4-python3-runtime==4.13.2 # latex2sympy2_extended
  regex==2026.11.15              # transformers 5.23 checks regex>=2025.10.22 at import; the machine's was not read
  pyzmq==27.3.0                  # not on the benchmark's path: grpo's decoupled mode (and its tests) import it
)
# Not brought: fastapi/uvicorn (grpo's reference server only, not imported by `grpo train` colocated).

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}"
  # one version of each: a second would stop the whole install there
  rm -f "$DEST"/"$(echo "$name" | tr - _)"-*.whl "$DEST"/"$name"-*.whl
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" "$spec"
done

if [ ! -f "$GSM8K/train.jsonl" ]; then
  echo "gpu_wheels.sh: $GSM8K/train.jsonl not found (set GRPO_GSM8K_DIR to the GSM8K folder)" >&2
  exit 1
fi
mkdir -p "$DEST/gsm8k"
install -m 644 "$GSM8K/train.jsonl" "$DEST/gsm8k/train.jsonl"  # the tokenizer's corpus and the prompts; never committed

ls -l "$DEST"/*.whl "$DEST/gsm8k"
size_kib=$(du -sk "$DEST" | cut -f1)
echo "gpu_wheels.sh: $(ls "$DEST"/*.whl | wc -l) wheels + GSM8K train.jsonl in $DEST: $((size_kib / 1024)) MiB"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "gpu_wheels.sh: over $LIMIT_MIB MiB: a device call carries 64 MiB with the working tree" >&2
  exit 1
fi
