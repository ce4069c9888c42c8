"""benchmarks/gpu_vs_trl.py stays runnable between GPU runs: its --tiny CPU path end to end, its table, its shapes.

The GPU figures themselves need a GPU (``make bench-gpu``); here the same code runs a tiny model on the
CPU, through the same child processes, timers and summaries, so a renamed config key or TRL argument
fails here instead of on the next (rare) GPU machine.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import gpu_report  # noqa: E402
import gpu_vs_trl  # noqa: E402
import runners  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
NO_TRL = "TRL side not run: trl is not installed (pip install 'trl>=1.16,<1.17', the `bench` extra)"
# Checkpointing and LoRA each on both sides; lora-gc only sets both flags at once (and grpo crashes on
# it at d7b4874: see /work/shared/notes/gpu-findings.md), the table's crash path is tested below.
TINY_CASES = ("full-gc", "lora")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, gsm8k_dir):
    out = tmp_path_factory.mktemp("bench-gpu") / "tiny.json"
    sides = "grpo,trl,plain" if HAS_TRL else "grpo,plain"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_vs_trl.py"), "--tiny", "--steps", "2",
         "--cases", ",".join(TINY_CASES), "--sides", sides, "--gsm8k", str(gsm8k_dir), "--threads", "2",
         "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def check_side(report: dict, side: str) -> None:
    settings = report["settings"]
    assert [row["case"] for row in report["cases"]] == list(TINY_CASES)
    for row in report["cases"]:
        s = row[side]
        assert "error" not in s, f"{row['case']} {side}: {s.get('error')}"
        assert s["steps"] == 2
        for key in ("step_s", "generate_s", "train_s", "generated_tokens_per_s", "update_tflops", "peak_rss_gb"):
            assert s[key] > 0, (row["case"], side, key)
        assert s["ref_logprobs_s"] >= 0  # beta 0.04: a reference pass ran (it may take under a millisecond)
        assert 0 < s["completion_length"] <= settings["max_new_tokens"]
        # the phases are parts of the step (the rest is bookkeeping between them)
        assert s["generate_s"] + s["train_s"] <= s["step_s"] * 1.01


@pytest.mark.slow
def test_tiny_run_times_the_grpo_side(tiny_run):
    report, stdout = tiny_run
    settings = report["settings"]
    assert (settings["P"], settings["G"], settings["max_new_tokens"], settings["device"]) == (2, 4, 8, "cpu")
    assert report["shape_name"] == "tiny" and report["matmul_peak_tflops"] > 0
    check_side(report, "grpo")
    assert "| full-gc |" in stdout and "| lora |" in stdout  # the markdown table is printed


@pytest.mark.slow
def test_tiny_run_times_the_trl_side(tiny_run):
    if not HAS_TRL:
        pytest.skip(NO_TRL)
    report, _ = tiny_run
    assert report["versions"]["trl"].startswith("1.16.")
    check_side(report, "trl")


@pytest.mark.slow
def test_tiny_run_times_the_plain_floor(tiny_run):
    # the plain fwd+bwd loop over the same tokens (issue 15's floor) runs each case's model setup
    report, stdout = tiny_run
    for row in report["cases"]:
        plain = row["plain"]
        assert "error" not in plain, f"{row['case']} plain: {plain.get('error')}"
        assert plain["steps"] == 2 and plain["train_s"] > 0 and plain["update_tflops"] > 0
        assert "update_gpu_busy" not in plain and "update_gpu_busy" not in row["grpo"]  # measured on CUDA only
        assert f"{plain['train_s']:.2f} s: {row['grpo']['train_s'] / plain['train_s']:.2f}x" in stdout


def test_plain_floor_trains_what_grpo_trains(tmp_path, tiny_model_dir, gsm8k_dir):
    """run_plain's update moves the weights grpo's update moves (every trainable parameter: full, or the
    LoRA adapters with the base frozen) and keeps the trainer's model setup (checkpointing on)."""
    import harness

    prompts = gpu_vs_trl.write_prompts(gsm8k_dir, tmp_path / "prompts.jsonl", 8)
    for lora_r, gradient_checkpointing in ((0, True), (16, False)):
        case = harness.make_case("tiny", tiny_model_dir, prompts, lora_r=lora_r, num_iterations=1, steps=2,
                                 threads=2, prompts_per_step=2, num_generations=2, max_completion_length=4,
                                 micro_batch_size=2, gradient_checkpointing=gradient_checkpointing)
        case["workdir"] = str(tmp_path / f"run-{lora_r}")
        import grpo.models.loading

        loaded = []
        load_policy = grpo.models.loading.load_policy

        def keep(*args, **kwargs):
            model = load_policy(*args, **kwargs)
            loaded.append((model, {n: p.detach().clone() for n, p in model.named_parameters()}))
            return model

        grpo.models.loading.load_policy = keep
        try:
            result = runners.run_plain(case)
        finally:
            grpo.models.loading.load_policy = load_policy
        assert len(result["train_s"]) == 2 and result["completion_tokens"] == 4 and result["mean_prompt_tokens"] > 4
        (model, before), = loaded
        moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert moved == trainable, (lora_r, sorted(trainable - moved)[:3], sorted(moved - trainable)[:3])
        assert (lora_r > 0) == all("lora_" in n for n in trainable)
        checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.2x name
        assert (model.is_gradient_checkpointing if checkpointing is None else checkpointing) == gradient_checkpointing


def test_device_choice_flags_are_config_overrides(tmp_path, tiny_model_dir):
    """--shared-prompt-pass / --column-bucket / --sdpa-backends reach grpo as a user sets them: config keys
    (docs/device-choices.md), nothing assigned into a module; "auto" leaves each key at its default."""
    import harness

    case = harness.make_case("tiny", tiny_model_dir, tmp_path / "prompts.jsonl", lora_r=0, num_iterations=1,
                             steps=2, threads=2, attn_implementation="sdpa")
    case["workdir"] = str(tmp_path)
    cfg = runners.ours_config({**case, "shared_prompt_pass": "auto", "sdpa_backends": "auto", "column_bucket": None})
    assert (cfg.train.shared_prompt_pass, cfg.train.column_bucket, cfg.model.sdpa_backends) == (None, None, None)
    cfg = runners.ours_config({**case, "shared_prompt_pass": "off", "sdpa_backends": "efficient,math",
                               "column_bucket": 16})
    assert (cfg.train.shared_prompt_pass, cfg.train.column_bucket, cfg.model.sdpa_backends) == (
        False, 16, "efficient,math")
    cfg = runners.ours_config({**case, "grpo_set": {"train.fused_lm_head": "false", "train.column_bucket": "8"}})
    assert cfg.train.fused_lm_head is False and cfg.train.column_bucket == 8  # --grpo-set: any key, applied last
    assert runners.ours_config({**case, "shared_prompt_pass": "on"}).train.shared_prompt_pass is True


def test_busy_fraction_counts_overlapping_kernels_once():
    assert runners.busy_fraction([], 10.0) == 0.0
    assert runners.busy_fraction([(0.0, 2.0), (5.0, 6.0)], 10.0) == pytest.approx(0.3)
    # two streams overlapping, one interval inside another, unsorted input
    assert runners.busy_fraction([(4.0, 9.0), (1.0, 3.0), (2.0, 5.0), (6.0, 7.0)], 10.0) == pytest.approx(0.8)
    assert runners.busy_fraction([(0.0, 10.0)], 10.0) == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiled_sees_a_busy_and_an_idle_gpu():
    import time

    a = torch.randn(4096, 4096, device="cuda")
    _, busy = runners.profiled(lambda: [a @ a for _ in range(50)])
    assert busy["update_profiled_s"] > 0 and busy["update_gpu_busy"] > 0.8  # back-to-back matmuls
    assert busy["update_kernels"] >= 50
    _, idle = runners.profiled(lambda: (a @ a, time.sleep(0.2)))
    assert idle["update_gpu_busy"] < 0.5  # one matmul, then the host sleeps


def test_shapes_have_the_published_qwen25_parameter_counts(tiny_tokenizer):
    """Counted on the meta device (no memory); the totals the Qwen2.5 model cards give (tied heads counted
    once), which pins every dimension of the table at once."""
    from grpo.models.tiny import build_qwen2

    expected = {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "3b": 3_085_938_688, "7b": 7_615_616_512}
    for shape, total in expected.items():
        with torch.device("meta"):
            model = build_qwen2(tiny_tokenizer, rope_theta=1e6, **gpu_vs_trl.SHAPES[shape])
        assert sum(p.numel() for p in model.parameters()) == total, shape


def test_the_moe_shape_is_a_qwen3_moe_of_the_stated_size_and_its_matmuls_count_the_routed_experts_used(
        tiny_tokenizer, tmp_path):
    from grpo.models.tiny import build_qwen3_moe

    dims = {k: v for k, v in gpu_vs_trl.SHAPES["moe"].items() if k != "family"}
    with torch.device("meta"):
        model = build_qwen3_moe(tiny_tokenizer, **dims)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.head_dim == 64
    assert sum(p.numel() for p in model.parameters()) == 1_809_222_656
    path = gpu_vs_trl.build_model("tiny-moe", tiny_tokenizer, tmp_path / "tiny-moe")  # its CPU form, saved
    body, head = gpu_vs_trl.matmul_params(path)
    experts = 2 * 3 * 64 * 64 * 4  # 2 layers x (gate, up, down) x hidden x expert width x 4 experts, k = 2 of them
    total = 664_448
    assert head == 8448 * 64 and body == total - head - experts // 2
    assert gpu_vs_trl.model_name("tiny-moe") == "qwen3-tiny-moe" and gpu_vs_trl.model_name("tiny") == "qwen2.5-tiny"


def report(cases: list[dict], **settings) -> dict:
    return {"device_name": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0", "transformers": "5.23.0",
            "trl": "1.16.0"}, "grpo_commit": "d7b4874", "shape_name": "1.5b", "shape": gpu_vs_trl.SHAPES["1.5b"],
            "settings": {"device": "cuda", "P": 16, "G": 8, "max_new_tokens": 256, "steps": 4,
                         "micro_batch_size": 16, **settings},
            "matmul_peak_tflops": 700.0, "matmul_dtype": "bfloat16", "cases": cases}


def side(step_s: float, generate_s: float, ref: float, update: float, tflops: float, gb: float) -> dict:
    return {"step_s": step_s, "generate_s": generate_s, "ref_logprobs_s": ref, "train_s": update,
            "generated_tokens_per_s": 32768 / generate_s, "update_tflops": tflops, "peak_gpu_gb": gb}


def test_table_gives_trl_over_grpo_and_marks_a_crash():
    full = {"case": "full", "grpo": side(15.7, 9.8, 1.78, 4.3, 120.0, 47.6),
            "trl": side(13.2, 10.6, 0.67, 1.9, 270.0, 56.1)}
    crashed = {"case": "lora-gc", "grpo": {"error": "AttributeError: boom"},
               "trl": side(21.9, 17.2, 0.86, 4.0, 90.0, 11.2)}
    table = gpu_report.markdown_table(report([full, crashed]))
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "| 15.70 | 13.20 | **0.84x** |" in rows["full"]  # 13.2 / 15.7, as the H100 notes give it
    assert "120 (17%) / 270 (39%)" in rows["full"]  # update TFLOP/s against the 700 TFLOP/s peak
    assert "| crash | 21.90 | - |" in rows["lora-gc"]
    assert "- lora-gc, grpo: AttributeError: boom" in table


def test_table_holds_the_update_against_the_plain_floor():
    full = {"case": "full", "grpo": dict(side(15.7, 9.8, 1.78, 4.3, 120.0, 47.6), update_gpu_busy=0.35),
            "trl": side(13.2, 10.6, 0.67, 1.9, 270.0, 56.1),
            "plain": {"train_s": 1.6, "update_tflops": 300.0, "update_gpu_busy": 0.97, "peak_gpu_gb": 40.0}}
    lora = {"case": "lora", "grpo": side(39.8, 32.8, 2.0, 7.6, 50.0, 25.1)}  # no plain side run
    table = gpu_report.markdown_table(report([full, lora]))
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "| 1.60 s: 2.69x / 1.19x | 35% / 97% |" in rows["full"]  # 4.3 / 1.6 and 1.9 / 1.6
    assert "| - | - / - |" in rows["lora"]


def test_merge_joins_cases_in_order_and_refuses_other_settings(tmp_path):
    a, b, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(report([{"case": "lora", "grpo": side(39.8, 32.8, 2.0, 7.6, 50.0, 25.1)}])))
    b.write_text(json.dumps(report([{"case": "full", "grpo": side(15.7, 9.8, 1.78, 4.3, 120.0, 47.6)}])))
    other.write_text(json.dumps(report([], steps=8)))
    plain = tmp_path / "plain.json"  # another call's side of the same case joins it
    plain.write_text(json.dumps(report([{"case": "lora", "plain": {"train_s": 2.0, "update_tflops": 90.0}}])))
    merged = gpu_report.merge([str(a), str(b), str(plain)], list(gpu_vs_trl.CASES))
    assert [row["case"] for row in merged["cases"]] == ["full", "lora"]
    assert set(merged["cases"][1]) == {"case", "grpo", "plain"} and merged["cases"][1]["grpo"]["step_s"] == 39.8
    with pytest.raises(SystemExit, match="another settings"):
        gpu_report.merge([str(a), str(other)], list(gpu_vs_trl.CASES))


def test_generation_speed_tiny_runs_every_engine(tmp_path):
    # benchmarks/generation_speed.py (issue 14's generation target) on a CPU: every engine runs on the full
    # and the LoRA policy, and the JSON carries the figures docs/guides/speed.md quotes.
    out = tmp_path / "gen.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "generation_speed.py"), "--tiny",
                           "--reps", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    for case in ("full", "lora"):
        rows = report["cases"][case]
        assert set(rows) == {"generate (dynamic cache, bf16 copy)", "hf (policy under autocast)", "hf-static"}
        for row in rows.values():
            assert row["seconds"] > 0 and row["tokens"] > 0 and row["speedup_vs_generate"] > 0
    assert "| lora | hf-static |" in proc.stdout


def test_memory_check_gpu_takes_each_phase_peak_at_its_boundaries(tmp_path, tiny_model_dir):
    """benchmarks/memory_check_gpu.py's phase marks, on a real 2-step run (num_iterations 2) on the CPU with
    counting stand-ins for CUDA's allocator counters: every phase is closed where it ends, in order, and
    the run's patches and optimizer hooks are gone afterwards."""
    import memory_check
    import memory_check_gpu

    import grpo.step.policy_update
    import grpo.training.colocated
    import grpo.training.loop
    from grpo.config import load_config

    prompts = memory_check.write_prompts(tmp_path)
    prompt_len = memory_check.longest_prompt(tiny_model_dir, prompts)
    values = memory_check.overrides(tiny_model_dir, prompts, tmp_path / "run", prompt_len, 0, False)
    cfg = load_config(None, values + ["train.max_steps=2", "rollout.max_completion_length=4"])
    reads = iter(range(1000))  # each peak read returns the next number: a phase's value says when it was closed
    peaks = memory_check_gpu.PhasePeaks(peak=lambda: next(reads), reset=lambda: None, allocated=lambda: -1)
    memory_check_gpu.train_with_phase_peaks(cfg, peaks)
    one_step = ["rollout", "update", "optimizer_step", "update", "optimizer_step"]
    assert peaks.order == one_step * 2 + ["after_training"]
    assert peaks.baseline == -1
    assert peaks.phases == {"rollout": 5, "update": 8, "optimizer_step": 9, "after_training": 10}
    assert grpo.training.loop.train_on_batch is grpo.step.policy_update.train_on_batch
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    torch.optim.SGD([weight], lr=0.1).step()  # the hooks were removed: no more marks
    assert len(peaks.order) == 11


@pytest.mark.slow
def test_gpu_session_script_parts_run_in_tiny_form(tmp_path, gsm8k_dir):
    """scripts/gpu_session.sh's next leases (issue 49: lease3, then lease4; issue 61: since) with GPU_SESSION_TINY=1:
    the same commands and flags with --tiny on the CPU, so a renamed flag fails here, not in a lent GPU's few minutes
    (since's FSDP2 run found hf-static's copy of a sharded policy crashing that way). The
    bench parts read GSM8K's prompts (skipped without the shared files, like every GSM8K test). The parts the H200
    leases already measured (gen, choices, jump: docs/device-choices.md) are not run here (the five parts took 12
    minutes of a loaded 2-core CI machine); their flags reach the config as
    test_device_choice_flags_are_config_overrides checks."""
    # GPU_SESSION_SECONDS: the lease parts skip what a GPU lease's minutes leave no room for; on a loaded 2-core CI
    # machine the tiny form took past the default 540 s and skipped the full-size run, so no deadline here
    env = {**os.environ, "GPU_SESSION_TINY": "1", "PYTHON": sys.executable, "OUT": str(tmp_path),
           "GRPO_GSM8K_DIR": str(gsm8k_dir), "GPU_SESSION_SECONDS": "100000"}
    def run_part(part: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_session.sh"), part], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=1800)  # a hang guard only

    # Both at once: each is mostly single-threaded process start-ups, their files differ, and the model cache takes
    # concurrent builds.
    parts = ("lease3", "lease4", "since")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for part, proc in zip(parts, pool.map(run_part, parts)):
            assert proc.returncode == 0, (part, proc.stderr[-4000:])
    assert json.loads((tmp_path / "full-size.json").read_text())["cases"][0]["grpo"]["steps"] == 2
    headline = json.loads((tmp_path / "full-lora.json").read_text())["cases"]
    assert [case["name"].split("/")[1] for case in headline] == ["full", "lora16"]
    assert all(case["trl"] and case["plain"] for case in headline)  # both baselines beside grpo
    assert [case["name"].split("/")[1] for case in json.loads((tmp_path / "gc.json").read_text())["cases"]] == [
        "full+gc", "lora16+gc"]
    assert (tmp_path / "model-cache" / "qwen2.5-tiny-random" / "config.json").is_file()  # built once, reused
    head = json.loads((tmp_path / "logprob_memory.json").read_text())
    assert [p["pass"] for p in head["passes"]] == ["training", "reference"]
    assert all(p["fused"]["peak_mib"] > 0 and p["logits"]["seconds"] > 0 for p in head["passes"])
    for name, checkpointed in (("length_sweep", False), ("length_sweep-gc", True)):
        sweep = json.loads((tmp_path / f"{name}.json").read_text())
        assert sweep["gradient_checkpointing"] is checkpointed and [r["completion_tokens"] for r in sweep["rows"]] == [32]
        assert all(sweep["rows"][0][head]["peak_mib"] > 0 for head in ("logits", "fused"))
    multiturn = {name: json.loads((tmp_path / f"multiturn-{name}.json").read_text()) for name in ("tiny-math", "tiny")}
    assert not multiturn["tiny-math"]["continue_all"] and multiturn["tiny"]["continue_all"]
    assert all(multiturn["tiny"]["engines"]["hf-static"][mode]["calls"] == 2 for mode in ("plain", "cached"))
    for k in (1, 4):  # the run's evaluation at the start and after the last step, beside its steps
        evaluated = json.loads((tmp_path / f"eval-k{k}.json").read_text())
        assert evaluated["settings"]["grpo_set"]["eval.num_samples"] == str(k)
        assert len(evaluated["cases"][0]["grpo"]["eval_s"]) == 2 and evaluated["cases"][0]["grpo"]["eval_over_step"] > 0
    lease4 = {name: json.loads((tmp_path / f"{name}.json").read_text())["settings"]
              for name in ("fused-off", "bucket-1")}
    assert lease4["fused-off"]["grpo_set"] == {"train.fused_lm_head": "false"}
    assert lease4["bucket-1"]["grpo_column_bucket"] == 1
    gc_shared = json.loads((tmp_path / "gc-shared.json").read_text())
    assert gc_shared["settings"]["grpo_shared_prompt_pass"] == "on"
    assert [case["name"].split("/")[1] for case in gc_shared["cases"]] == ["full+gc", "lora16+gc"]
    # since (issue 61 step 3): the -m gpu tests (skipping here), FSDP2, the MoE shape without and with replay
    assert "skipped" in (tmp_path / "gpu-tests.txt").read_text()
    since = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("fsdp2", "moe", "moe-replay")}
    assert since["fsdp2"]["settings"]["grpo_set"] == {"train.fsdp": "true"}
    assert "error" not in since["fsdp2"]["cases"][0]["grpo"]  # hf-static's copy of the sharded policy crashed it
    moe, replay = (since[name]["cases"][0] for name in ("moe", "moe-replay"))
    assert since["moe"]["shape_name"] == "tiny-moe" and moe["plain"] and "moe_routing_mismatch" not in moe["grpo"]
    assert moe["grpo"]["moe_aux_loss"][0] > 0 and set(replay["grpo"]["moe_routing_mismatch"]) == {0.0}  # replayed
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_session.sh"), "nonsense"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown part nonsense" in proc.stderr


def test_profiled_ops_tables_name_the_operators_and_reach_the_report():
    a = torch.randn(64, 64)
    result, found = runners.profiled_ops(lambda: (a @ a).sum(), rows=5)
    assert torch.equal(result, (a @ a).sum())
    assert "aten::mm" in found["update_top_ops_host"] or "aten::matmul" in found["update_top_ops_host"]
    grpo_side = dict(side(15.7, 9.8, 1.78, 4.3, 120.0, 47.6), update_gpu_busy=0.35, update_kernels=12345, **found)
    text = gpu_report.profile_tables(report([{"case": "full", "grpo": grpo_side, "trl": side(13, 10, .6, 1.9, 1, 1)}]))
    assert text.startswith("## full, grpo: one update, 12345 kernels, GPU busy 35%")
    assert found["update_top_ops_host"] in text
    assert gpu_report.profile_tables(report([{"case": "full", "grpo": side(1, 1, 1, 1, 1, 1)}])) == ""


def test_plain_profiled_updates_reuse_the_steps_prompts(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    """On CUDA the plain side runs two profiled updates after the timed ones, over a prompts file that holds
    only the timed steps' prompts (P x steps, as gpu_vs_trl.py writes it): they reuse those prompts (the H200
    run of ab7d641 crashed here with an IndexError on both cases)."""
    import harness

    prompts = gpu_vs_trl.write_prompts(gsm8k_dir, tmp_path / "prompts.jsonl", 2 * 2)  # P=2 x steps=2
    case = harness.make_case("tiny", tiny_model_dir, prompts, lora_r=0, num_iterations=1, steps=2, threads=2,
                             prompts_per_step=2, num_generations=2, max_completion_length=4, micro_batch_size=2)
    case.update(workdir=str(tmp_path / "run"), profile_update=True)
    profiled = []
    monkeypatch.setattr(runners, "profile_update", lambda fn, extra: (profiled.append(extra), fn(), {})[1:])
    result = runners.run_plain(case)
    assert profiled == [1, 2] and len(result["train_s"]) == 2


def test_model_cache_builds_once_and_never_reuses_a_half_built_model(tmp_path, monkeypatch):
    """--model-cache: the 1.5B model is built once per GPU machine; a build cut short leaves nothing reused."""
    builds = []

    def build(shape, tokenizer, path):
        builds.append(path)
        (path / "config.json").write_text("{}")  # the last file a build writes
        return path

    monkeypatch.setattr(gpu_vs_trl, "build_model", build)
    monkeypatch.setattr(gpu_vs_trl, "gsm8k_tokenizer", lambda gsm8k: None)
    first = gpu_vs_trl.cached_model("tiny", tmp_path, tmp_path / "cache")
    assert first == tmp_path / "cache" / "qwen2.5-tiny-random" and (first / "config.json").is_file()
    assert gpu_vs_trl.cached_model("tiny", tmp_path, tmp_path / "cache") == first and len(builds) == 1

    def killed(shape, tokenizer, path):
        (path / "model.safetensors").write_text("half")
        raise KeyboardInterrupt  # a device call's time limit, mid-write

    monkeypatch.setattr(gpu_vs_trl, "build_model", killed)
    with pytest.raises(KeyboardInterrupt):
        gpu_vs_trl.cached_model("1.5b", tmp_path, tmp_path / "cache")
    assert not (tmp_path / "cache" / "qwen2.5-1.5b-random").exists()  # the next run builds it afresh

    def raced(shape, tokenizer, path):  # another process finishes the same build meanwhile
        build(shape, tokenizer, path)
        build(shape, tokenizer, tmp_path / "cache" / "qwen2.5-1.5b-random")

    (tmp_path / "cache" / "qwen2.5-1.5b-random").mkdir()
    monkeypatch.setattr(gpu_vs_trl, "build_model", raced)
    partial_builds = set((tmp_path / "cache").glob(".*"))  # the killed build's
    assert gpu_vs_trl.cached_model("1.5b", tmp_path, tmp_path / "cache") == tmp_path / "cache" / "qwen2.5-1.5b-random"
    assert set((tmp_path / "cache").glob(".*")) == partial_builds  # its own build removed, the other's kept
