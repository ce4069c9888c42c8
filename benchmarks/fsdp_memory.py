"""FSDP2 against DDP on the CPU: peak memory per rank and step time at 1, 2 and 3 ranks, and ``grpo memory``'s
estimate of the peak beside each (about 10 minutes on a 2-core machine).

A random Qwen2 of 28M parameters (hidden 512, 8 layers, 8192-token vocabulary, tied embeddings) in fp32, full
fine-tuning, trained by ``grpo train`` under torchrun for 3 steps: 6 prompts x G=2 a step, micro-batch 2, 24
completion tokens, ``loss.beta 0.04`` (a reference), so each rank samples, scores and updates as a real run does;
``data.max_prompt_length`` is the longest rendered prompt (what the estimate sizes). Learners: DDP, FSDP2 as
configured by default (every micro-batch reduce-scatters, layers freed after forward), and FSDP2 with
``fsdp.accumulate_unsharded`` + ``fsdp.reshard_after_forward: false`` (DDP's communication, more memory).

Measured per rank, as ``benchmarks/memory_check.py`` measures one process: the peak of its anonymous memory
(``RssAnon``, read every 5 ms) minus its value right after the policy was loaded (imports, data and the mapped
checkpoint are in the baseline; glibc maps every allocation of 64 KiB or more on its own, so memory follows the
live tensors). The largest rank's is reported. ``states``: the bytes of this rank's parameters (its shards under
FSDP2) and AdamW states after the run, counted from the tensors themselves. ``step_s``: the mean of
``time/step_s`` over steps 2 and 3. ``estimate``: ``estimate_memory(cfg, gpus=N, device="cpu")``'s peak.

Writes benchmarks/results/fsdp_memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from memory_check import AnonPeak, _status_kib, longest_prompt  # noqa: E402  (the same measurement)

MIB = 1024**2
SIZE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536)
COMPLETION_TOKENS = 24


def build_model(workdir: Path) -> Path:
    from grpo.models.tiny import build_qwen2, build_tokenizer

    tokenizer = build_tokenizer()
    path = workdir / "model"
    build_qwen2(tokenizer, seed=0, vocab_size=8192, max_position_embeddings=1024, **SIZE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


DATA = "synthetic:seed=1,n=64"
LEARNERS = {"ddp": {}, "fsdp": {"train.fsdp": True},
            "fsdp-unsharded": {"train.fsdp": True, "fsdp.accumulate_unsharded": True,
                               "fsdp.reshard_after_forward": False}}


def overrides(model: Path, out: Path, learner: str, prompt_len: int) -> list[str]:
    values = {
        "model.name_or_path": model, "data.train": DATA, "data.eval": None, "data.max_prompt_length": prompt_len,
        "rollout.num_generations": 2, "rollout.max_completion_length": COMPLETION_TOKENS,
        "train.prompts_per_step": 6, "train.micro_batch_size": 2, "train.max_steps": 3, "train.save_steps": 100,
        "train.save_final": False, "train.output_dir": out, "train.overwrite": True, "train.device": "cpu",
        "train.seed": 0, "loss.beta": 0.04, "optim.learning_rate": 1e-5, **LEARNERS[learner],
        "log.report_to": "[]", "log.progress_bar": False, "log.plots": False, "log.num_samples": 0,
        "rewards": "[{name: 'rewards_for_tests:letters'}]",
    }
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


def _state_bytes(trainable) -> int:
    """This rank's parameters (their local shards) and optimizer states, from the tensors."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = sum(local(p).numel() * local(p).element_size() for p in trainable.policy.parameters())
    states = sum(local(v).numel() * local(v).element_size() for s in trainable.optimizer.state.values()
                 for v in s.values() if hasattr(v, "numel"))
    return params + states


def child(case_file: str) -> None:
    """One rank: ``grpo train`` with the anonymous-memory peak above the loaded policy."""
    import grpo.training.colocated
    import grpo.training.prepare
    from grpo.config import load_config

    case = json.loads(Path(case_file).read_text())
    cfg = load_config(None, case["overrides"])
    seen: dict = {}
    load_policy, build = grpo.training.prepare.policy_for, grpo.training.prepare.build_trainable

    def loaded(*args, **kwargs):
        policy = load_policy(*args, **kwargs)
        seen["baseline"] = _status_kib("RssAnon") * 1024
        return policy

    def built(*args, **kwargs):
        seen["trainable"] = build(*args, **kwargs)
        return seen["trainable"]

    grpo.training.prepare.policy_for, grpo.training.prepare.build_trainable = loaded, built
    with AnonPeak() as anon:
        grpo.training.colocated.train(cfg)
    rank = int(os.environ.get("RANK", "0"))
    Path(case["result"].format(rank=rank)).write_text(json.dumps({
        "rank": rank, "peak_mib": (anon.peak - seen["baseline"]) / MIB,
        "states_mib": _state_bytes(seen["trainable"]) / MIB}))


def run_case(model: Path, workdir: Path, ranks: int, learner: str, prompt_len: int, port: int) -> dict:
    name = f"{learner}-{ranks}"
    out = workdir / name
    case = {"overrides": overrides(model, out, learner, prompt_len), "result": str(workdir / f"{name}-{{rank}}.json")}
    case_file = workdir / f"{name}.json"
    case_file.write_text(json.dumps(case))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "integration")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(port), __file__, "--child", str(case_file)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads((workdir / f"{name}-{rank}.json").read_text()) for rank in range(ranks)]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m["time/step_s"] for m in metrics if "time/step_s" in m][1:]
    from grpo.commands.memory import estimate_memory
    from grpo.config import load_config

    cfg = load_config(None, case["overrides"])
    config = json.loads((model / "config.json").read_text())
    estimate = estimate_memory(cfg, gpus=ranks, model_config=config, device="cpu")
    peak = max(r["peak_mib"] for r in rows)
    return {"learner": learner, "ranks": ranks, "peak_mib": peak,
            "peak_by_rank_mib": [r["peak_mib"] for r in rows], "states_mib": max(r["states_mib"] for r in rows),
            "step_s": sum(steps) / len(steps), "estimate_mib": estimate.total_gb * 1024,
            "estimate_error": (estimate.total_gb * 1024 - peak) / peak, "estimate_phase": estimate.peak_phase}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="1,2,3")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    from transport_helpers import free_port  # tests/: the free-port helper

    workdir = Path(tempfile.mkdtemp(prefix="grpo-fsdp-memory-"))
    model = build_model(workdir)
    config = json.loads((model / "config.json").read_text())
    prompt_len = longest_prompt(model, DATA)
    print(f"Qwen2 hidden {SIZE['hidden_size']}, {SIZE['num_layers']} layers, vocab {config['vocab_size']}, fp32, "
          f"prompts up to {prompt_len} tokens; per rank, MiB above the loaded policy", flush=True)
    print(f"{'learner':14} {'ranks':>5} {'peak':>8} {'estimate':>9} {'error':>7} {'params+adam':>12} {'step s':>7}")
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for learner in LEARNERS:
            if learner == "fsdp-unsharded" and ranks == 1:
                continue  # one rank: nothing to keep unsharded
            row = run_case(model, workdir, ranks, learner, prompt_len, free_port())
            rows.append(row)
            print(f"{row['learner']:14} {ranks:5} {row['peak_mib']:8.1f} {row['estimate_mib']:9.1f} "
                  f"{row['estimate_error']:+7.1%} {row['states_mib']:12.1f} {row['step_s']:7.2f}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"model": {**SIZE, "vocab_size": config["vocab_size"]}, "dtype": "fp32", "prompt_tokens": prompt_len,
              "completion_tokens": COMPLETION_TOKENS, "threads_per_rank": 1, "rows": rows}
    (RESULTS / "fsdp_memory.json").write_text(json.dumps(report, indent=2))
    print(f"written to {RESULTS / 'fsdp_memory.json'}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    main()
