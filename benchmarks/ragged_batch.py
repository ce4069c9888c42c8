"""An update over a batch whose completion lengths vary widely (many short, a few long, as GRPO produces):
token positions actually run and seconds, fixed micro-batches of rows against ``train.max_tokens_per_micro_batch``
and against packed rows (``train.pack_sequences``) (about 1-2 minutes on a 2-core CPU).

A random Qwen2 (hidden 128, 4 layers, the test tokenizer's vocabulary, fp32) and one rollout batch of 16 groups x
G=4 = 64 rows, 48-token prompts; completions of 16-64 tokens except one group of 512 and one of 256: the long
rows pad whatever fixed micro-batch they land in. ``train_on_batch`` (one iteration, beta 0.04, loss grpo) with
micro-batches of 16 rows, then with the token budget at the same peak width (16 rows x (48 + 64) = 1,792
positions; rows up to 64), with ``auto`` (the largest 16-row micro-batch's width, any number of rows), then fixed
16-row micro-batches packed into one sequence each. Counted: the token positions the model runs (a hook on the input embedding:
every forward, prompt passes included) and the update's seconds (best of ``--reps``); the gradients are
equal (tests/test_policy_update.py). Writes benchmarks/results/ragged_batch.json.

    python benchmarks/ragged_batch.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RESULTS = ROOT / "benchmarks" / "results"


def ragged_batch(vocab: int, groups: int = 16, G: int = 4, prompt: int = 48, seed: int = 0):
    import torch

    from grpo.rollout.generation import Generation
    from grpo.step.records import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (groups * G,), generator=gen)
    lengths[5 * G:6 * G], lengths[11 * G:12 * G] = 512, 256  # the long groups
    Lc, N = int(lengths.max()), groups * G
    completion_mask = (torch.arange(Lc)[None] < lengths[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (groups, prompt), generator=gen).repeat_interleave(G, 0)
    logp = -torch.rand(N, Lc, generator=gen)
    return RolloutBatch(
        generation=Generation(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
                              completion_ids=torch.randint(3, vocab, (N, Lc), generator=gen) * completion_mask,
                              completion_mask=completion_mask, truncated=torch.zeros(N, dtype=torch.bool),
                              completions=[""] * N),
        rewards=torch.randn(N, generator=gen), reward_parts=torch.randn(N, 1, generator=gen), reward_names=["r"],
        advantages=torch.randn(N, generator=gen), old_logprobs=logp, ref_logprobs=logp + 0.1, prompts=[""] * groups)


class _Plain:
    """The learner interface over plain autograd (no optimizer step: the update's passes are what is timed)."""

    def __init__(self, model):
        self.module, self.lr = model, 0.0

    def accumulating(self, last: bool):
        import contextlib

        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        loss.backward()

    def finish_update(self):
        from grpo.parallel.learners import UpdateOutcome

        self.module.zero_grad(set_to_none=True)
        return UpdateOutcome(0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default=str(RESULTS / "ragged_batch.json"))
    args = parser.parse_args()
    import torch

    from grpo.models.tiny import build_qwen2, build_tokenizer
    from grpo.step.policy_update import LossSettings, train_on_batch
    from grpo.parallel.distributed import DistInfo

    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    model = build_qwen2(tokenizer, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256,
                        max_position_embeddings=1024, seed=0).train()
    batch = ragged_batch(len(tokenizer))
    positions = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: positions.append(a[0].numel()))
    real = int(batch.generation.completion_mask.sum()) + 48 * 16  # each prompt once, every completion token
    from grpo.step.logprobs import LogprobPass

    cases = {"fixed 16 rows": dict(micro_batch_size=16, max_tokens_per_micro_batch=None),
             "token budget 1,792": dict(micro_batch_size=64, max_tokens_per_micro_batch=16 * (48 + 64)),
             "token budget auto, 16 rows": dict(micro_batch_size=16, max_tokens_per_micro_batch="auto"),
             "packed, 16 rows": dict(micro_batch_size=16, max_tokens_per_micro_batch=None,
                                     logprob_pass=LogprobPass(pack=True))}
    rows = []
    print(f"64 rows (16 groups x 4), 48-token prompts, completions 16-64 tokens but one group of 512 and one of 256; "
          f"{real:,} real tokens; CPU {os.cpu_count()} cores, {args.threads} threads")
    for name, sizes in cases.items():
        settings = LossSettings(epsilon=0.2, epsilon_high=None, beta=0.04, loss_type="grpo", max_completion_length=512,
                                temperature=1.0, num_iterations=1, max_grad_norm=None, **sizes)
        best = float("inf")
        for _ in range(args.reps):
            positions.clear()
            started = time.perf_counter()
            train_on_batch(_Plain(model), batch, settings, DistInfo())
            best = min(best, time.perf_counter() - started)
        row = {"case": name, "micro_batch_size": sizes["micro_batch_size"],
               "max_tokens_per_micro_batch": sizes["max_tokens_per_micro_batch"], "pack": "logprob_pass" in sizes,
               "positions_run": sum(positions), "forwards": len(positions), "seconds": best}
        rows.append(row)
        print(f"{name:20} {row['positions_run']:>8,} positions run in {row['forwards']:3} forwards  {best:6.2f} s",
              flush=True)
    fixed = rows[0]
    report = {"machine": f"CPU, {os.cpu_count()} cores", "threads": args.threads, "real_tokens": real,
              "model": "Qwen2 hidden 128, 4 layers, test vocabulary, random, fp32", "cases": rows,
              "positions_ratio": {r["case"]: r["positions_run"] / fixed["positions_run"] for r in rows[1:]},
              "time_ratio": {r["case"]: r["seconds"] / fixed["seconds"] for r in rows[1:]}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for name in report["time_ratio"]:
        print(f"{name}: {report['positions_ratio'][name]:.2f}x the positions, {report['time_ratio'][name]:.2f}x the "
              "time of fixed rows")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
