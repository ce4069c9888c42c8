#!/usr/bin/env bash
# Issues 14 and 15's GPU measurements, in parts that each fit one device call (10 minutes), in the order
# they matter; a lent GPU's 30 minutes take about the first five. Run on the GPU machine, in the repository root, with
# .whl/ carried (stage it here first: `bash scripts/gpu_wheels.sh`); results go to $OUT (or ./gpu-out).
#
#   run: bash scripts/gpu_session.sh gen       # generation alone: hf-static vs generate vs hf, full and
#                                              #   LoRA, per-call times (the 2x jump), torch's attention
#                                              #   choice against efficient,math (~5 min on an H100)
#   run: bash scripts/gpu_session.sh full      # gpu_vs_trl full, full-gc: grpo (hf-static) / TRL / plain
#   run: bash scripts/gpu_session.sh lora      # gpu_vs_trl lora, lora-gc
#   run: bash scripts/gpu_session.sh choices   # grpo alone, full and LoRA: as shipped / shared prompt
#                                              #   pass off / attention backends efficient,math
#   run: bash scripts/gpu_session.sh memory    # grpo memory against max_memory_allocated (~2 min)
#   run: bash scripts/gpu_session.sh jump      # the 2x generation jump inside training, default hf engine:
#                                              #   per-step generate times over 6 steps, as shipped and
#                                              #   with attention backends efficient,math
#   run: bash scripts/gpu_session.sh fullsize  # grpo alone, a full-size step: 64 prompts x 8 x 512 tokens
#                                              #   (issue 14's goal: under 60 s on one H100), 3 steps
#   run: bash scripts/gpu_session.sh head      # the fused LM head against whole logits at the 1.5B body and
#                                              #   Qwen's vocabulary, 8 x 1024 completion tokens (~2 min)
#   run: bash scripts/gpu_session.sh sweep     # the longest completion that fits in 80 GB at the 1.5B body, whole
#                                              #   logits vs the fused head, without and with checkpointing (~3 min)
#   run: bash scripts/gpu_session.sh multiturn # multi-turn rollouts, cached turns against whole-conversation
#                                              #   prefills: tiny-math (hf-static's CUDA graphs with cached turns,
#                                              #   never run on a GPU), then the 1.5B shape (~3 min)
#   run: bash scripts/gpu_session.sh eval      # in-training evaluation at the 1.5B shape: 128 GSM8K prompts, greedy
#                                              #   and k=4, against a training step (issue 29's "less than a step")
#   run: bash scripts/gpu_session.sh lease4    # the lease after lease3 (GPU_SESSION_SECONDS likewise): sweep,
#                                              #   multiturn, eval, the update with the fused head off at steady
#                                              #   state, train.column_bucket=1 against the CUDA default 64, then
#                                              #   full-gc and lora-gc with the shared prompt pass on
#   run: bash scripts/gpu_session.sh since     # after lease3 (issue 61 step 3; GPU_SESSION_SECONDS likewise): the
#                                              #   -m gpu tests, FSDP2 at the 1.5B shape beside lease3's full, a
#                                              #   Qwen3-MoE (--shape moe) without and with routing replay
#   run: bash scripts/gpu_session.sh lease3    # the next lease (GPU_SESSION_SECONDS likewise): the CUDA defaults the
#                                              #   second decided (plain pass, fixed rows, no-grad plain logits)
#                                              #   against TRL and the plain loop, full and LoRA, with GPU busy;
#                                              #   the fused head at 1.5B; full-gc, lora-gc; a 2-step full-size run
#   run: bash scripts/gpu_session.sh lease2    # (run on an H200 at 33ea38b, cut after the A/B) what the first left
#                                              #   unmeasured: shared prompt pass on/off and the fused LM head
#                                              #   off for full fine-tuning,
#                                              #   the fused head at 1.5B, full-gc and lora-gc against TRL and
#                                              #   the plain loop, a 2-step full-size run
#   run: bash scripts/gpu_session.sh lease     # a 15-minute lease in one call of at most 10 minutes (with
#                                              #   GPU_SESSION_SECONDS, default 540): full and LoRA against TRL
#                                              #   and the plain loop at 3 steps, then memory, then a 2-step
#                                              #   full-size run, each cut at the deadline (results so far kept)
#
# then here: python benchmarks/gpu_vs_trl.py --merge full.json lora.json --out benchmarks/results/gpu_vs_trl.json
# Each part prints its table; the JSON files say which GPU, which commit and every setting.
# GPU_SESSION_TINY=1 runs the same commands with --tiny on a CPU, in this environment (PYTHON, default
# python3), to check the script itself (tests/test_bench_gpu_script.py does); memory has no tiny form.
set -euo pipefail

part="${1:?usage: gpu_session.sh gen|full|lora|choices|memory|jump|fullsize|head|sweep|multiturn|eval|lease|lease2|lease3|lease4|since}"
out="${OUT:-gpu-out}"
python="${PYTHON:-python3}"
mkdir -p "$out"
if [ -n "${GPU_SESSION_TINY:-}" ]; then
  tiny="--tiny"
  full_size=""  # --full-size and --tiny exclude each other: the tiny preset stands in
  jump_steps=""  # the tiny bench runs 2 steps
  sweep_plain="--lengths 32"  # one length on the CPU's tiny body: the commands and both heads, not the figures
  sweep_gc="--lengths 32"
  model_cache="$out/model-cache" shape=tiny
  multiturn_tiny="--prompts 2 --generations 2 --max-tokens 8 --turns 2"
  multiturn_shape="--prompts 2 --generations 2 --max-tokens 8 --turns 2"
  eval_limit=8
  bench="$python benchmarks/gpu_vs_trl.py --tiny --steps 2 --engine hf-static --model-cache $out/model-cache"
  [ "$part" != memory ] || { echo "gpu_session.sh: memory needs a GPU" >&2; exit 2; }
else
  tiny=""
  full_size="--full-size --steps 3"
  jump_steps="--steps 6"  # five steps after the warm-up: enough to see a jump that came every other step
  # one row of 64 + L tokens, full fine-tuning; without checkpointing the body's activations end the sweep
  # first (about 3 GB per 1,000 tokens at this body), with it the logits do
  sweep_plain="--device cuda --body 1.5b --budget-gib 80 --lengths 1024,2048,4096,8192,16384,32768"
  sweep_gc="--device cuda --body 1.5b --budget-gib 80 --lengths 4096,8192,16384,32768,65536,131072"
  model_cache=/tmp/grpo-bench-model shape=1.5b
  multiturn_tiny="--device cuda --reps 3"  # the shipped tiny-math: its rows end turns with an EOS
  multiturn_shape="--device cuda --prompts 16 --generations 8 --max-tokens 128 --turns 3 --reps 2"
  eval_limit=128  # a training step's prompts x G is 128 rows: greedy evaluation generates as many
  site=/tmp/grpo-site
  if [ ! -d "$site" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
  fi
  export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  # the 1.5B model is built once per machine (30+ s a run otherwise), outside $OUT, whose files come back
  bench="$python benchmarks/gpu_vs_trl.py --gsm8k .whl/gsm8k --engine hf-static --model-cache /tmp/grpo-bench-model"
fi

case "$part" in
  gen)
    $python benchmarks/generation_speed.py $tiny --out "$out/generation_speed.json"
    $python benchmarks/generation_speed.py $tiny --cases full --sdpa-backends efficient,math \
      --out "$out/generation_speed-efficient.json"
    ;;
  full)
    $bench --cases full,full-gc --out "$out/full.json"
    ;;
  lora)
    $bench --cases lora,lora-gc --out "$out/lora.json"
    ;;
  choices)  # grpo alone, A/B in one call: as shipped, train.shared_prompt_pass off, model.sdpa_backends
            # efficient,math: the CUDA defaults docs/device-choices.md says are still to be measured
    $bench --cases full,lora --sides grpo --no-busy --out "$out/as-shipped.json"
    $bench --cases full,lora --sides grpo --no-busy --shared-prompt-pass off --out "$out/shared-off.json"
    $bench --cases full,lora --sides grpo --no-busy --sdpa-backends efficient,math --out "$out/sdpa-efficient.json"
    ;;
  memory)
    OUT="$out" $python benchmarks/memory_check_gpu.py  # writes $out/memory_check_gpu.json
    ;;
  fullsize)
    $bench $full_size --cases full --sides grpo --no-busy --out "$out/full-size.json"
    ;;
  jump)  # grpo's generation time jumped 2x between identical steps on the H100 (8.3-32 s, hf engine):
         # per-step times with today's hf engine, and whether torch's attention choice (cuDNN plans) is why
    for backends in default efficient,math; do  # --engine hf after $bench's hf-static: the last one counts
      flag=""; [ "$backends" = default ] || flag="--sdpa-backends $backends"
      $bench --engine hf $jump_steps $flag --cases full --sides grpo --no-busy --out "$out/jump-$backends.json"
      $python -c 'import json, sys; s = json.load(open(sys.argv[1]))["cases"][0]["grpo"]["per_step"]
print(sys.argv[2], "generate s per step:", " ".join(f"{x:.2f}" for x in s["generate_s"]))' "$out/jump-$backends.json" "$backends"
    done
    ;;
  head)  # issue 28's target on a GPU: the log-prob passes' peak and time, fused head vs whole logits
    if [ -n "${GPU_SESSION_TINY:-}" ]; then
      $python benchmarks/logprob_memory.py --completion 32 --reps 1 --out "$out/logprob_memory.json"
    else
      $python benchmarks/logprob_memory.py --device cuda --body 1.5b --out "$out/logprob_memory.json"
    fi
    ;;
  sweep)  # issue 30 item 4: the longest completion that fits in 80 GB with and without the fused head
    $python benchmarks/length_sweep.py $sweep_plain --out "$out/length_sweep.json"
    $python benchmarks/length_sweep.py $sweep_gc --gradient-checkpointing --out "$out/length_sweep-gc.json"
    ;;
  multiturn)  # issue 27 on a GPU: the prefill tokens and time cached turns save, and their peak memory
    $python benchmarks/multiturn_prefill.py $multiturn_tiny --out "$out/multiturn-tiny-math.json"
    # the benchmark's random model (built once, as the bench parts build it): rows continue whether or not
    # their turn ended, random weights seldom sampling an EOS
    model=$($python -c 'import sys; from pathlib import Path; sys.path.insert(0, "benchmarks"); import gpu_vs_trl
print(gpu_vs_trl.cached_model(sys.argv[1], gpu_vs_trl.find_gsm8k(None), Path(sys.argv[2])))' "$shape" "$model_cache" | tail -1)
    $python benchmarks/multiturn_prefill.py $multiturn_shape --model "$model" --continue-all \
      --out "$out/multiturn-$shape.json"
    ;;
  eval)  # the run's evaluation through hf-static (at the start, cold, and after the last step), beside its steps
    # (GSM8K's first train problems stand in for a held-out set: timing only, the weights are random)
    eval_set="$($python -c 'import sys; sys.path.insert(0, "benchmarks"); import gpu_vs_trl
print(gpu_vs_trl.find_gsm8k(None) / "train.jsonl")' | tail -1)"
    for k in 1 4; do
      $bench --steps 3 --cases full --sides grpo --no-busy --grpo-set "data.eval=$eval_set" \
        --grpo-set data.eval_limit=$eval_limit --grpo-set eval.num_samples=$k --out "$out/eval-k$k.json"
      $python -c 'import json, sys; s = json.load(open(sys.argv[1]))["cases"][0]["grpo"]
step, ratio = s["step_s"], s["eval_over_step"]
print(f"k={sys.argv[2]}: evaluations", " ".join(f"{x:.2f}" for x in s["eval_s"]), f"s; step {step:.2f} s;",
      f"the last is {ratio:.2f} steps")' "$out/eval-k$k.json" "$k"
    done
    ;;
  lease)  # a lease now lends 15 minutes in all, start included: the headline first, each part cut at the deadline
    deadline=$((SECONDS + ${GPU_SESSION_SECONDS:-540}))
    left() { echo $((deadline - SECONDS)); }
    timeout "$(left)" $bench --steps 3 --cases full,lora --out "$out/full-lora.json" || echo "lease: full,lora ended $?"
    if [ "$(left)" -gt 100 ] && [ -z "${GPU_SESSION_TINY:-}" ]; then
      OUT="$out" timeout "$(left)" $python benchmarks/memory_check_gpu.py || echo "lease: memory ended $?"
    fi
    if [ "$(left)" -gt 150 ]; then
      timeout "$(left)" $bench ${full_size:+--full-size} --steps 2 --cases full --sides grpo --no-busy \
        --out "$out/full-size.json" || echo "lease: fullsize ended $?"
    fi
    ;;
  lease2)  # after the first lease (H200, ab7d641): the update was host-bound (GPU busy 39%) with the shared pass
    deadline=$((SECONDS + ${GPU_SESSION_SECONDS:-540}))
    left() { echo $((deadline - SECONDS)); }
    for pass in auto off; do  # the A/B that decides train.shared_prompt_pass on CUDA, on one machine, with the
                              # profiled update (GPU busy, operator tables): the update's target is 85% busy
      timeout "$(left)" $bench --steps 3 --cases full --sides grpo --shared-prompt-pass $pass \
        --out "$out/shared-$pass.json" || echo "lease2: shared $pass ended $?"
    done
    # the fused LM head is on by size at this shape (16 x 257 x 151,936 logits): the same step without it
    timeout "$(left)" $bench --steps 3 --cases full --sides grpo --no-busy --grpo-set train.fused_lm_head=false \
      --out "$out/fused-off.json" || echo "lease2: fused off ended $?"
    if [ "$(left)" -gt 120 ]; then
      if [ -n "${GPU_SESSION_TINY:-}" ]; then head_args="--completion 32 --reps 1"; else head_args="--device cuda --body 1.5b"; fi
      timeout "$(left)" $python benchmarks/logprob_memory.py $head_args --out "$out/logprob_memory.json" \
        || echo "lease2: head ended $?"
    fi
    if [ "$(left)" -gt 200 ]; then
      timeout "$(left)" $bench --steps 3 --cases full-gc,lora-gc --out "$out/gc.json" || echo "lease2: gc ended $?"
    fi
    if [ "$(left)" -gt 150 ]; then
      timeout "$(left)" $bench ${full_size:+--full-size} --steps 2 --cases full --sides grpo --no-busy \
        --out "$out/full-size.json" || echo "lease2: fullsize ended $?"
    fi
    ;;
  lease3)  # after the second lease (H200, 33ea38b): one grpo run took 2-4 minutes, so the headline comes first
    deadline=$((SECONDS + ${GPU_SESSION_SECONDS:-540}))
    left() { echo $((deadline - SECONDS)); }
    timeout "$(left)" $bench --steps 3 --cases full,lora --out "$out/full-lora.json" || echo "lease3: full,lora ended $?"
    if [ "$(left)" -gt 120 ]; then
      if [ -n "${GPU_SESSION_TINY:-}" ]; then head_args="--completion 32 --reps 1"; else head_args="--device cuda --body 1.5b"; fi
      timeout "$(left)" $python benchmarks/logprob_memory.py $head_args --out "$out/logprob_memory.json" \
        || echo "lease3: head ended $?"
    fi
    if [ "$(left)" -gt 200 ]; then
      timeout "$(left)" $bench --steps 3 --cases full-gc,lora-gc --no-busy --out "$out/gc.json" || echo "lease3: gc ended $?"
    fi
    if [ "$(left)" -gt 150 ]; then
      timeout "$(left)" $bench ${full_size:+--full-size} --steps 2 --cases full --sides grpo --no-busy \
        --out "$out/full-size.json" || echo "lease3: fullsize ended $?"
    fi
    ;;
  lease4)  # after lease3: what docs/device-choices.md still lists as unmeasured, and issue 30 item 4's sweep
    deadline=$((SECONDS + ${GPU_SESSION_SECONDS:-540}))
    left() { echo $((deadline - SECONDS)); }
    timeout "$(left)" bash "$0" sweep || echo "lease4: sweep ended $?"  # timeout ends the part's whole group
    if [ "$(left)" -gt 200 ]; then
      timeout "$(left)" bash "$0" multiturn || echo "lease4: multiturn ended $?"
    fi
    if [ "$(left)" -gt 300 ]; then
      timeout "$(left)" bash "$0" eval || echo "lease4: eval ended $?"
    fi
    # the update keeps the fused head from 2^26 logits on CUDA; its cost at steady state against whole logits,
    # beside lease3's full run as shipped (profiled: GPU busy and the operator tables)
    if [ "$(left)" -gt 150 ]; then
      timeout "$(left)" $bench --steps 3 --cases full --sides grpo --grpo-set train.fused_lm_head=false \
        --out "$out/fused-off.json" || echo "lease4: fused off ended $?"
    fi
    if [ "$(left)" -gt 150 ]; then  # the CUDA default bucket 64 was chosen from the H100's cuDNN plans, unmeasured
      timeout "$(left)" $bench --steps 3 --cases full --sides grpo --column-bucket 1 \
        --out "$out/bucket-1.json" || echo "lease4: bucket 1 ended $?"
    fi
    # the shared prompt pass under gradient checkpointing (grpo.step.checkpointing) came after lease3: CUDA's
    # plain-pass default was chosen without it; beside lease3's gc.json (the plain pass) for the same cases
    if [ "$(left)" -gt 200 ]; then
      timeout "$(left)" $bench --steps 3 --cases full-gc,lora-gc --sides grpo --no-busy --shared-prompt-pass on \
        --out "$out/gc-shared.json" || echo "lease4: gc shared ended $?"
    fi
    ;;
  since)  # issue 61 step 3: what was built since the H200 leases, never run on a GPU, each part cut at the deadline
    deadline=$((SECONDS + ${GPU_SESSION_SECONDS:-540}))
    left() { echo $((deadline - SECONDS)); }
    # the -m gpu tests: hf-static's CUDA graphs with in-flight weights, fp16 loss scaling, tf32, compile, 8-bit
    # optimizers, chunked log-probs (on a CPU each skips, saying it needs CUDA)
    timeout "$(left)" "$python" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_in_flight_static.py \
      tests/test_static_engine.py tests/test_fp16.py tests/test_tf32.py tests/test_torch_compile.py tests/test_optim.py \
      tests/test_token_logprobs_chunked.py tests/test_algorithm_losses.py tests/test_memory_savers.py \
      > "$out/gpu-tests.txt" 2>&1 || echo "since: gpu tests ended $? (see gpu-tests.txt)"
    tail -n 15 "$out/gpu-tests.txt"
    # FSDP2 (one rank: its sharding is then the wrapping alone) against lease3's full.json, the plain learner: the
    # update and the peak (generation differs: a sharded policy samples with hf, as auto picks, not hf-static)
    if [ "$(left)" -gt 150 ]; then
      timeout "$(left)" $bench --engine auto --steps 3 --cases full --sides grpo --no-busy --grpo-set train.fsdp=true \
        --out "$out/fsdp2.json" || echo "since: fsdp2 ended $?"
    fi
    # a Qwen3-MoE (64 experts, 8 a token) without and with routing replay, on the hf engine (the one that records
    # routing); the plain loop beside the first
    if [ "$(left)" -gt 200 ]; then
      timeout "$(left)" $bench --shape moe --engine hf --steps 3 --cases full --sides grpo,plain --no-busy \
        --out "$out/moe.json" || echo "since: moe ended $?"
    fi
    if [ "$(left)" -gt 150 ]; then
      timeout "$(left)" $bench --shape moe --engine hf --steps 3 --cases full --sides grpo --no-busy \
        --grpo-set loss.routing_replay=true --out "$out/moe-replay.json" || echo "since: moe replay ended $?"
    fi
    ;;
  *)
    echo "gpu_session.sh: unknown part $part (gen, full, lora, choices, memory, fullsize, jump, head, sweep, multiturn," \
      "eval, lease, lease2, lease3, lease4 or since)" >&2
    exit 2
    ;;
esac
