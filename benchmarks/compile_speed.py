"""train.torch_compile against the eager update: seconds per step of a short `grpo train`, after warm-up.

Two parts (``--part``):

- ``run``: `grpo train RECIPE` in a fresh process, the same recipe and seed with and without
  ``train.torch_compile`` (A B alternating, ``--reps`` times), reading ``time/train_s`` (the update, which is all
  that compiles) and ``time/step_s`` of every step from metrics.jsonl, and each run's wall and CPU seconds. The
  first steps compile a graph for each new kind of call (the step's ``time/train_s`` jumps); "after warm-up" is the
  median over the steps from ``--warmup-steps`` on, and the table also gives the steps that still compiled there
  (an update over twice the eager median). Each compiled run gets an empty inductor cache
  (``TORCHINDUCTOR_CACHE_DIR``), so its compile times are a first run's.
- ``update``: the update alone, in one process, on the recipe's model: ``--steps`` batches of its shape (its
  rendered prompts, G completions of random tokens and lengths up to its max_completion_length), each trained
  by the eager learner and then by the compiled one (A B per batch, so both see the same machine), timing wall
  and process CPU seconds. On a shared machine the CPU seconds are the steadier figure.

    python benchmarks/compile_speed.py [--part both] [--recipe configs/smoke-cpu.yaml] [--steps 12] \
        [--warmup-steps 6] [--reps 1] [--backend inductor] [--out benchmarks/results/compile_speed_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_case(recipe: str, steps: int, compiled: bool, backend: str, folder: Path) -> dict:
    overrides = [f"train.max_steps={steps}", f"train.save_steps={steps}", f"train.output_dir={folder}",
                 "train.overwrite=true", "data.eval=null", "log.progress_bar=false", "log.report_to=[]",
                 "log.plots=false", "log.num_samples=0", "train.save_final=false"]
    if compiled:
        overrides += ["train.torch_compile=true", f"train.torch_compile_backend={backend}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(folder.parent / "inductor")}
    started, cpu_before = time.perf_counter(), _children_cpu_s()
    done = subprocess.run([sys.executable, "-m", "grpo", "train", recipe, *overrides], cwd=REPO,
                          capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - started, _children_cpu_s() - cpu_before
    if done.returncode != 0:
        raise RuntimeError(f"grpo train failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/train_s" in r]
    return {"train_s": [r["time/train_s"] for r in rows], "step_s": [r["time/step_s"] for r in rows],
            "loss": [r["loss"] for r in rows], "wall_s": wall, "cpu_s": cpu}


def _children_cpu_s() -> float:
    """User + system CPU seconds of the finished child processes so far: what a run cost whatever else the
    machine was running (its wall time stretches on a busy machine, its CPU time much less)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary(runs: list[dict], warmup: int, eager_update: float | None) -> dict:
    """Medians over every run's steps from ``warmup`` on; a step whose update took over twice the eager median
    is counted as still compiling."""
    after = [s for r in runs for s in r["train_s"][warmup:]]
    steps = [s for r in runs for s in r["step_s"][warmup:]]
    late = sum(s > 2 * eager_update for s in after) if eager_update else 0
    return {"first_update_s": statistics.median(r["train_s"][0] for r in runs),
            "update_s_after_warmup": statistics.median(after), "step_s_after_warmup": statistics.median(steps),
            "late_compiles": late, "wall_s": statistics.median(r["wall_s"] for r in runs),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs)}


def update_batches(recipe: str, steps: int, seed: int = 0) -> tuple[object, list]:
    """(the recipe's config, ``steps`` rollout batches of its shape): P of its rendered prompts each, G rows per
    prompt, completions of random tokens with random lengths up to max_completion_length, random advantages."""
    import torch

    from grpo.config import load_config
    from grpo.rollout.generation import Generation
    from grpo.step.records import RolloutBatch
    from grpo.tasks import run_system_prompt
    from grpo.training.inputs import GivenInputs, tokenizer_and_data

    cfg = load_config(REPO / recipe, ["data.eval=null"])
    inputs = tokenizer_and_data(cfg, GivenInputs())
    tok, system = inputs.tokenizer, run_system_prompt(cfg, inputs.task)
    P, G, Lc = cfg.train.prompts_per_step, cfg.rollout.num_generations, cfg.rollout.max_completion_length
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        texts = [tok.apply_chat_template(([{"role": "system", "content": system}] if system else [])
                                         + [{"role": "user", "content": ex.question}], add_generation_prompt=True,
                                         tokenize=False) for ex in inputs.train_set[step * P:(step + 1) * P]]
        prompts = tok(texts, padding=True, return_tensors="pt")  # left-padded
        ids, mask = prompts.input_ids.repeat_interleave(G, 0), prompts.attention_mask.repeat_interleave(G, 0)
        lengths = torch.randint(1, Lc + 1, (P * G,), generator=gen)
        completion_mask = (torch.arange(Lc)[None] < lengths[:, None]).long()
        generation = Generation(prompt_ids=ids, prompt_mask=mask, completion_mask=completion_mask,
                                completion_ids=torch.randint(3, len(tok), (P * G, Lc), generator=gen),
                                truncated=lengths == Lc, completions=[""] * (P * G))
        batches.append(RolloutBatch(generation=generation, rewards=torch.zeros(P * G), reward_names=["r"],
                                    reward_parts=torch.zeros(P * G, 1), advantages=torch.randn(P * G, generator=gen),
                                    old_logprobs=None, ref_logprobs=-torch.rand(P * G, Lc, generator=gen),
                                    prompts=texts))
    return cfg, batches


def update_part(recipe: str, steps: int, warmup: int, backend: str) -> dict:
    """The update alone, eager and compiled A B on the same batches in this process (see the module docstring)."""
    import torch

    from grpo.models.loading import load_policy
    from grpo.parallel.distributed import DistInfo
    from grpo.parallel.trainable import build_trainable
    from grpo.step.policy_update import train_on_batch
    from grpo.training.settings import loss_settings

    cfg, batches = update_batches(recipe, steps)
    policy = load_policy(cfg.model, torch.device("cpu"))
    settings = loss_settings(cfg, None, "cpu")
    compiled_cfg = load_config_with(cfg, backend)
    learners = {"eager": build_trainable(cfg, policy, DistInfo()).learner,
                "compiled": build_trainable(compiled_cfg, policy, DistInfo()).learner}
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in learners}
    for step, batch in enumerate(batches):
        for name, learner in learners.items():
            wall, cpu = time.perf_counter(), time.process_time()
            train_on_batch(learner, batch, settings, DistInfo())
            times[name]["wall"].append(time.perf_counter() - wall)
            times[name]["cpu"].append(time.process_time() - cpu)
        print(f"update {step + 1}: " + ", ".join(f"{n} {t['wall'][-1]:.2f} s" for n, t in times.items()), flush=True)
    eager_wall = statistics.median(times["eager"]["wall"][warmup:])
    return {name: {"first_update_s": t["wall"][0], "wall_s_after_warmup": statistics.median(t["wall"][warmup:]),
                   "cpu_s_after_warmup": statistics.median(t["cpu"][warmup:]),
                   "late_compiles": sum(w > 2 * eager_wall for w in t["wall"][warmup:]) if name == "compiled" else 0,
                   "wall_s": t["wall"], "cpu_s": t["cpu"]} for name, t in times.items()}


def load_config_with(cfg, backend: str):
    """``cfg`` with train.torch_compile on (``backend``)."""
    from dataclasses import replace

    return replace(cfg, train=replace(cfg.train, torch_compile=True, torch_compile_backend=backend))


def run_part(args) -> dict:
    """The whole-run A B (see the module docstring): its summaries and every run's figures."""
    runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    for rep in range(args.reps):
        for case in ("eager", "compiled"):
            with tempfile.TemporaryDirectory() as tmp:
                runs[case].append(run_case(args.recipe, args.steps, case == "compiled", args.backend,
                                           Path(tmp) / "run"))
            print(f"rep {rep + 1} {case}: update s per step {[round(s, 2) for s in runs[case][-1]['train_s']]}",
                  flush=True)
    eager = summary(runs["eager"], args.warmup_steps, None)
    compiled = summary(runs["compiled"], args.warmup_steps, eager["update_s_after_warmup"])
    print(f"\n{'grpo train':10} {'first update s':>15} {'update s/step':>14} {'step s/step':>12} "
          f"{'late compiles':>14} {'run wall s':>11} {'run CPU s':>10}")
    for name, s in (("eager", eager), ("compiled", compiled)):
        print(f"{name:10} {s['first_update_s']:15.2f} {s['update_s_after_warmup']:14.3f} "
              f"{s['step_s_after_warmup']:12.3f} {s['late_compiles']:14d} {s['wall_s']:11.1f} {s['cpu_s']:10.1f}")
    ratio = compiled["update_s_after_warmup"] / eager["update_s_after_warmup"]
    print(f"compiled / eager update after warm-up: {ratio:.2f}x")
    return {"eager": eager, "compiled": compiled, "compiled_over_eager_update": ratio, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("run", "update", "both"), default="both")
    parser.add_argument("--recipe", default="configs/smoke-cpu.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compile_speed_cpu.json")
    args = parser.parse_args()
    import torch  # the version recorded; the runs import their own in the child processes

    load_before = os.getloadavg()[0]  # a busy machine's figures are inflated: recorded beside them
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "recipe": args.recipe,
              "steps": args.steps, "warmup_steps": args.warmup_steps, "reps": args.reps, "backend": args.backend}
    if args.part in ("run", "both"):
        result["run"] = run_part(args)
    if args.part in ("update", "both"):
        with tempfile.TemporaryDirectory() as cache:  # a first compile here too, not the run part's cached one
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            update = update_part(args.recipe, args.steps, args.warmup_steps, args.backend)
        print(f"\n{'update':10} {'first update s':>15} {'wall s/update':>14} {'CPU s/update':>13} {'late compiles':>14}")
        for name, u in update.items():
            print(f"{name:10} {u['first_update_s']:15.2f} {u['wall_s_after_warmup']:14.3f} "
                  f"{u['cpu_s_after_warmup']:13.3f} {u['late_compiles']:14d}")
        print(f"compiled / eager after warm-up: wall "
              f"{update['compiled']['wall_s_after_warmup'] / update['eager']['wall_s_after_warmup']:.2f}x, CPU "
              f"{update['compiled']['cpu_s_after_warmup'] / update['eager']['cpu_s_after_warmup']:.2f}x")
        result["update"] = update
    result["load_average_1min"] = [load_before, os.getloadavg()[0]]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
