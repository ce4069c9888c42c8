"""``grpo memory``: the seeds' Qwen2.5-3B figures, ZeRO, checkpointing, reference, fits, JSON, config.json
folders, and the activation formulas against what autograd really keeps on tiny CPU models."""

from __future__ import annotations

import json

import pytest
import torch
from memory_helpers import saved_bytes

from grpo.config import ConfigError, load_config
from grpo.commands.memory import BUILTIN_CONFIGS, ModelShape, estimate_memory, format_table, run_memory_command
from grpo.commands.memory.formulas import (
    activation_bytes,
    logits_bytes,
    prompts_per_micro_batch,
    shared_prompt_activation_bytes,
)
from grpo.commands.memory.shapes import lora_params, lora_targets

QWEN3B = "Qwen/Qwen2.5-3B-Instruct"
# The seeds' setting: one GPU, bf16, gradient checkpointing, micro-batch 4 of 256 + 512 tokens.
# the seeds' setting; their figures were measured sampling with HF's loop (no sampling copy: rollout.engine hf,
# where the default auto is hf-static on CUDA)
SEED = [f"model.name_or_path={QWEN3B}", "model.bf16=true", "model.gradient_checkpointing=true",
        "train.micro_batch_size=4", "data.max_prompt_length=256", "rollout.max_completion_length=512",
        "rollout.engine=hf"]
GIB = 1024**3


def estimate(*overrides: str, **kwargs):
    return estimate_memory(load_config(None, [*SEED, *overrides]), **kwargs)


@pytest.mark.parametrize("name, params", [
    # Published parameter counts of Qwen2.5 (tied embeddings counted once for 0.5B-3B).
    ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768), ("Qwen/Qwen2.5-1.5B-Instruct", 1_543_714_304),
    ("Qwen/Qwen2.5-3B-Instruct", 3_085_938_688), ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512),
    # Qwen3-30B-A3B ("30.5B") and Llama 3.1 70B ("70.6B"), counted on their model classes / the Llama formula
    ("Qwen/Qwen3-30B-A3B", 30_532_122_624), ("meta-llama/Llama-3.1-70B-Instruct", 70_553_706_496)])
def test_builtin_table_gives_the_published_parameter_counts(name, params):
    assert ModelShape.from_config(BUILTIN_CONFIGS[name], name).num_params() == params


def test_qwen3b_full_bf16_adamw_reproduces_the_seeds_48_to_60_gb():
    est = estimate("loss.beta=0", mixed_precision=True)
    gb = est.per_device_gb
    # 2 weights + 2 gradients + 12 AdamW (fp32 master, m, v) = 16 B x 3.086B params = 46.0 GiB before activations.
    assert gb["weights"] + gb["gradients"] + gb["optimizer"] == pytest.approx(3_085_938_688 * 16 / GIB, abs=0.01)
    assert 48 <= est.total_gb <= 60
    # With the KL reference (a bf16 copy of the policy) it still lands in the seeds' range.
    assert 48 <= estimate(mixed_precision=True).total_gb <= 60


def test_deepspeed_bf16_and_grpo_torch_bf16_both_keep_fp32_master_weights(tmp_path):
    zero2 = tmp_path / "zero2.json"
    zero2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    ds = estimate("loss.beta=0", f"train.deepspeed={zero2}")
    assert ds.per_device_gb["optimizer"] == pytest.approx(3_085_938_688 * 12 / GIB, abs=0.01)
    assert 48 <= ds.total_gb <= 60
    # grpo's torch path: fp32 master weights under bf16 autocast, fp32 gradients and AdamW m, v, plus
    # the bf16 copies autocast caches of the layer linears' weights.
    torch_path = estimate("loss.beta=0")
    gb = torch_path.per_device_gb
    shape = ModelShape.from_config(BUILTIN_CONFIGS[QWEN3B], QWEN3B)
    linear = shape.linear_params()
    assert gb["weights"] == pytest.approx((3_085_938_688 * 4 + linear * 2) / GIB, abs=0.01)
    assert gb["optimizer"] == pytest.approx(3_085_938_688 * 8 / GIB, abs=0.01)
    assert gb["gradients"] == pytest.approx(3_085_938_688 * 4 / GIB, abs=0.01)
    assert any("fp32 master weights" in note for note in torch_path.notes)


def test_qwen3b_lora_r16_reproduces_the_seeds_8_to_12_gb():
    est = estimate("model.lora_r=16")
    adapter = lora_params(ModelShape.from_config(BUILTIN_CONFIGS[QWEN3B], QWEN3B), 16, lora_targets("all-linear"))
    # r x (in + out) for q, k, v, o, gate, up, down over 36 layers.
    assert adapter == 36 * 16 * ((2048 + 2048) + 2 * (2048 + 256) + (2048 + 2048) + 3 * (2048 + 11008))
    assert est.per_device_gb["weights"] == pytest.approx((3_085_938_688 * 2 + adapter * 4) / GIB, abs=0.001)
    assert est.per_device_gb["optimizer"] == pytest.approx(adapter * 8 / GIB, abs=0.001)
    assert est.per_device_gb["reference"] == 0  # the adapter disabled is the reference
    assert 8 <= est.total_gb <= 12


def test_zero3_over_4_gpus_divides_weights_gradients_and_optimizer(tmp_path):
    configs = {}
    for stage in (0, 3):
        path = tmp_path / f"zero{stage}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        configs[stage] = estimate(f"train.deepspeed={path}", gpus=4).per_device_gb
    shape = ModelShape.from_config(BUILTIN_CONFIGS[QWEN3B], QWEN3B)
    gathered = shape.largest_module_params() * 2 / GIB  # the module being computed is gathered in full
    assert configs[3]["gradients"] == pytest.approx(configs[0]["gradients"] / 4, abs=0.001)
    assert configs[3]["optimizer"] == pytest.approx(configs[0]["optimizer"] / 4, abs=0.001)
    assert configs[3]["weights"] == pytest.approx(configs[0]["weights"] / 4 + gathered, abs=0.001)
    assert configs[3]["activations"] == configs[0]["activations"]


def test_gradient_checkpointing_lowers_activations():
    on = estimate().per_device_gb["activations"]
    off = estimate("model.gradient_checkpointing=false").per_device_gb["activations"]
    assert on < off / 10


def test_reference_follows_beta_lora_dtype_and_ref_path():
    params = 3_085_938_688
    assert estimate("model.lora_r=16").per_device_gb["reference"] == 0
    assert estimate("loss.beta=0").per_device_gb["reference"] == 0
    assert estimate().per_device_gb["reference"] == pytest.approx(params * 2 / GIB, abs=0.001)
    assert estimate("model.ref_torch_dtype=float32").per_device_gb["reference"] == pytest.approx(
        params * 4 / GIB, abs=0.001)
    teacher = estimate("model.lora_r=16", "model.ref_name_or_path=Qwen/Qwen2.5-7B-Instruct")
    assert teacher.per_device_gb["reference"] == pytest.approx(7_615_616_512 * 2 / GIB, abs=0.001)
    decoupled = estimate("train.mode=decoupled", "decoupled.trainer_ranks=2", "train.prompts_per_step=8")
    assert decoupled.per_device_gb["reference"] == 0 and decoupled.gpus == 2
    assert any("sampler" in note for note in decoupled.notes)


def test_fits_needs_gpu_gb_and_compares_the_total():
    assert estimate().fits is None
    est = estimate(gpu_gb=80, mixed_precision=True)
    assert est.fits is True and est.total_gb <= 80
    assert estimate(gpu_gb=24, mixed_precision=True).fits is False
    with pytest.raises(ConfigError, match="--gpu-gb"):
        estimate(gpu_gb=0)


def test_components_sum_to_the_total_when_the_update_is_the_peak():
    est = estimate("model.lora_r=16", "train.fused_lm_head=false")  # whole logits: the update is the peak
    assert est.peak_phase == "update"
    assert sum(est.per_device_gb.values()) == pytest.approx(est.total_gb, abs=0.01)
    table = format_table(est)
    for name in ("weights", "gradients", "optimizer", "activations", "logits", "reference", "kv_cache", "total"):
        assert name in table


def test_colocated_vllm_reservation_counts_in_every_phase():
    cfg = load_config(None, SEED + ["model.lora_r=16"])
    cfg.rollout.engine = "vllm"  # set directly: the config's engine choices may not list vllm yet
    est = estimate_memory(cfg, gpu_gb=80, vllm_gpu_memory_utilization=0.3)
    assert est.per_device_gb["kv_cache"] == pytest.approx(0.3 * 80, abs=0.001)
    hf = estimate_memory(load_config(None, SEED + ["model.lora_r=16"]), gpu_gb=80)
    assert est.phases_gb["update"] == pytest.approx(hf.phases_gb["update"] + 24, abs=0.01)
    assert est.phases_gb["rollout"] > 24  # held while sampling too


def test_hf_static_engine_counts_its_bf16_sampling_copy_in_every_phase():
    # the copy lives for the whole run: 2 B per parameter on CUDA, in weights and in every phase
    hf = estimate("model.lora_r=16", "rollout.engine=hf")
    static = estimate("model.lora_r=16", "rollout.engine=hf-static")
    copy_gb = 3_085_938_688 * 2 / GIB  # Qwen2.5-3B's published parameter count
    assert static.per_device_gb["weights"] == pytest.approx(hf.per_device_gb["weights"] + copy_gb, abs=0.01)
    for phase, gb in hf.phases_gb.items():
        assert static.phases_gb[phase] == pytest.approx(gb + copy_gb, abs=0.01), phase
    assert "sampling copy" in static.how["weights"]


def test_auto_engine_is_counted_as_the_engine_the_device_runs():
    # rollout.engine auto (the default): hf-static's sampling copy on CUDA, none on a CPU or with a 4-bit base
    static = estimate("model.lora_r=16", "rollout.engine=hf-static")
    assert estimate("model.lora_r=16", "rollout.engine=auto").per_device_gb == static.per_device_gb
    assert (estimate("model.lora_r=16", "rollout.engine=auto", device="cpu").per_device_gb
            == estimate("model.lora_r=16", device="cpu").per_device_gb)
    assert "sampling copy" not in estimate("model.lora_r=16", "rollout.engine=auto",
                                           "model.load_in_4bit=true").how["weights"]


def test_fused_lm_head_counts_one_chunk_of_logits_not_the_micro_batchs():
    # seed: micro-batch 4 x 513 positions of Qwen's 151,936 vocabulary; fused by size (null) or when set
    from grpo.commands.memory.formulas import fused_logits_bytes, logits_bytes

    whole = estimate("model.lora_r=16", "train.fused_lm_head=false")
    fused = estimate("model.lora_r=16")
    assert estimate("model.lora_r=16", "train.fused_lm_head=true").per_device_gb == fused.per_device_gb
    shape = dict(micro_batch=4, positions=513, vocab_size=151936)
    assert whole.per_device_gb["logits"] == pytest.approx(logits_bytes(**shape, p=2) / GIB, abs=0.001)
    assert fused.per_device_gb["logits"] == pytest.approx(fused_logits_bytes(**shape) / GIB, abs=0.001)
    # four float32 chunk tensors in LogsumexpBackward; 55 columns: 2^25 // (4 x 151936)
    assert fused_logits_bytes(**shape) == 4 * 4 * 4 * 55 * 151936
    assert "fused LM head" in fused.how["logits"] and fused.total_gb < whole.total_gb


def test_json_output_shape(capsys):
    assert run_memory_command(None, SEED, gpus=None, gpu_gb=80, json_output=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["per_device_gb"]) == {"weights", "gradients", "optimizer", "activations", "logits", "reference",
                                         "critic", "kv_cache", "overhead"}
    assert isinstance(out["total_gb"], float) and out["fits"] is True


def test_local_config_json_folder_is_read(tiny_tokenizer, tmp_path):
    from grpo.models.tiny import build_qwen2

    model = build_qwen2(tiny_tokenizer, hidden_size=64, num_layers=2, seed=0)
    model.save_pretrained(tmp_path / "model")
    cfg = load_config(None, [f"model.name_or_path={tmp_path / 'model'}", "train.micro_batch_size=8"])
    est = estimate_memory(cfg, device="cpu")
    params = sum(p.numel() for p in model.parameters())  # tied LM head counted once, as the estimate
    assert est.assumptions["params"] == params
    assert est.per_device_gb["weights"] == round(params * 4 / GIB, 3)
    assert est.per_device_gb["overhead"] == 0
    assert "config.json" in est.notes[0]


def test_unknown_model_and_lora_targets_are_configuration_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.name_or_path"):
        estimate_memory(load_config(None, ["model.name_or_path=someone/unknown-model"]))
    with pytest.raises(ConfigError, match="model.name_or_path"):
        estimate_memory(load_config(None, [f"model.name_or_path={tmp_path / 'missing'}"]))
    with pytest.raises(ConfigError, match="lora_target_modules"):
        estimate("model.lora_r=8", "model.lora_target_modules=[c_attn]")


# ---------------------------------------------------------------- formulas against autograd on tiny models


def _tiny(tokenizer, dtype, lora: bool, targets, gradient_checkpointing: bool = False):
    from grpo.models.tiny import build_qwen2

    model = build_qwen2(tokenizer, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=352,
                        seed=0).to(dtype)
    shape = ModelShape.from_config(model.config.to_dict(), "tiny")
    if gradient_checkpointing:  # as grpo.models.loading.load_policy
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        if gradient_checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    model.train()
    return model, shape


def _batch(vocab: int, b: int = 4, prompt: int = 48, completion: int = 32):
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(b, prompt, dtype=torch.long)
    prompt_mask[1::2, :10] = 0  # left padding: the padding mask real batches have
    return (torch.randint(0, vocab, (b, prompt), generator=g), prompt_mask,
            torch.randint(0, vocab, (b, completion), generator=g), torch.ones(b, completion, dtype=torch.long))


def _backward_peak_bytes(model, rows) -> int:
    """Peak live CPU tensor bytes (the profiler's allocation events) over one micro-batch's forward and
    backward through grpo's own log-prob path, after a first one so that gradients already exist."""
    from torch.profiler import ProfilerActivity, profile

    from grpo.step.logprobs import completion_logprobs

    def step():
        logprobs = completion_logprobs(model, *rows, 1.0)
        (-(logprobs * rows[3]).sum()).backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora, targets", [(False, "all-linear"), (True, "all-linear"), (True, ["q_proj", "v_proj"]),
                                           (True, ["o_proj", "down_proj"])])
def test_saved_activations_match_autograd(tiny_tokenizer, dtype, lora, targets):
    # Every tensor autograd keeps for backward (storages counted once, parameters left out) against the
    # tensor-by-tensor count; what the formula leaves out is small (RoPE cos/sin, rsqrt, logsumexp, ids).
    model, shape = _tiny(tiny_tokenizer, dtype, lora, targets)
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(shape.vocab_size)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    kept = saved_bytes(model, lambda: model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1))
    p = 2 if dtype == torch.bfloat16 else 4
    expected = activation_bytes(shape, micro_batch=4, seq_len=80, p=p, lora_targets=lora_targets(targets) if lora
                                else None, lora_r=8, attention="sdpa", gradient_checkpointing=False,
                                logits=10**12)  # huge logits: the saved tensors alone, no backward temporaries
    assert expected == pytest.approx(kept, rel=0.01)


@pytest.mark.parametrize("gc", [False, True])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_peak_matches_the_profiler(tiny_tokenizer, dtype, lora, gc):
    # Distinct prompts in every row: the plain one-sequence-per-row pass.
    model, shape = _tiny(tiny_tokenizer, dtype, lora, "all-linear", gradient_checkpointing=gc)
    peak = _backward_peak_bytes(model, _batch(shape.vocab_size))
    p = 2 if dtype == torch.bfloat16 else 4
    logits = logits_bytes(micro_batch=4, positions=33, vocab_size=shape.vocab_size, p=p)
    expected = logits + activation_bytes(shape, micro_batch=4, seq_len=80, p=p,
                                         lora_targets=lora_targets("all-linear") if lora else None, lora_r=8,
                                         attention="sdpa", gradient_checkpointing=gc, logits=logits)
    print(f"estimated {expected} measured {peak} ({(expected - peak) / peak:+.3f})")
    assert expected == pytest.approx(peak, rel=0.08)


def test_qlora_packs_the_layers_linears_in_about_half_a_byte_and_8bit_adamw_keeps_2_bytes_of_states():
    bf16 = estimate("model.lora_r=16", "model.lora_target_modules=all-linear")
    qlora = estimate("model.lora_r=16", "model.lora_target_modules=all-linear", "model.load_in_4bit=true")
    shape = ModelShape.from_config(BUILTIN_CONFIGS[QWEN3B], QWEN3B)
    linear = shape.linear_params()
    saved_gb = linear * (2 - 4.127 / 8) / 2**30  # bf16 -> NF4 on the layers' linears only
    assert qlora.per_device_gb["weights"] == pytest.approx(bf16.per_device_gb["weights"] - saved_gb, abs=2e-3)
    assert 2.0 < qlora.per_device_gb["weights"] < 3.0  # Qwen2.5-3B: ~1.3 GB of NF4 layers + 0.6 GB embeddings
    full = estimate("model.lora_r=0")
    eight = estimate("model.lora_r=0", "optim.optimizer=adamw_8bit")
    n = shape.num_params()
    assert eight.per_device_gb["optimizer"] == pytest.approx(n * 2 / 2**30, abs=2e-3)
    assert full.per_device_gb["optimizer"] == pytest.approx(n * 8 / 2**30, abs=2e-3)  # fp32 m + v (autocast path)


def _grouped_batch(vocab: int, G: int = 4):
    """Two prompts (48 tokens, and 38 left-padded to 48), each repeated for G rows; 32-token completions."""
    prompt_ids, prompt_mask, _, _ = _batch(vocab, b=2)
    g = torch.Generator().manual_seed(1)
    return (prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0),
            torch.randint(0, vocab, (2 * G, 32), generator=g), torch.ones(2 * G, 32, dtype=torch.long))


def _shared_kwargs(shape, p, lora):
    return {"micro_batch": 8, "prompts": 2, "prompt_len": 48, "completion_len": 32, "p": p,
            "lora_targets": lora_targets("all-linear") if lora else None, "lora_r": 8, "attention": "sdpa"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_saved_activations_match_autograd(tiny_tokenizer, dtype, lora):
    # grpo.step.logprobs runs each distinct prompt once and the completions over its cache: what autograd
    # keeps then (two prompt passes, eight completion rows with their own prompt K/V) is counted.
    from grpo.step.logprobs import _shared_prompt_logits, shared_prompt_index

    model, shape = _tiny(tiny_tokenizer, dtype, lora, "all-linear")
    prompt_ids, prompt_mask, completion_ids, completion_mask = _grouped_batch(shape.vocab_size)
    kept = saved_bytes(model, lambda: _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids,
                                                             completion_mask, *shared_prompt_index(prompt_ids, prompt_mask)))
    p = 2 if dtype == torch.bfloat16 else 4
    expected = shared_prompt_activation_bytes(shape, **_shared_kwargs(shape, p, lora), logits=10**12)
    unshared = activation_bytes(shape, micro_batch=8, seq_len=80, p=p, lora_targets=_shared_kwargs(shape, p, lora)[
        "lora_targets"], lora_r=8, attention="sdpa", gradient_checkpointing=False, logits=10**12)
    assert expected < 0.8 * unshared  # the point of sharing, and what the planner must now count
    assert expected == pytest.approx(kept, rel=0.02)


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_backward_peak_matches_the_profiler(tiny_tokenizer, lora):
    model, shape = _tiny(tiny_tokenizer, torch.float32, lora, "all-linear")
    peak = _backward_peak_bytes(model, _grouped_batch(shape.vocab_size))
    logits = logits_bytes(micro_batch=8, positions=33, vocab_size=shape.vocab_size, p=4)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected = logits + shared_prompt_activation_bytes(shape, **_shared_kwargs(shape, 4, lora), logits=logits,
                                                       pending_gradients=4 * trained)
    print(f"estimated {expected} measured {peak} ({(expected - peak) / peak:+.3f})")
    assert expected == pytest.approx(peak, rel=0.08)


def test_prompts_per_micro_batch():
    assert prompts_per_micro_batch(16, 8) == 2  # whole groups
    assert prompts_per_micro_batch(4, 8) == 1  # a part of one group
    assert prompts_per_micro_batch(6, 4) == 2  # rows 0-5, 6-11, 12-17: never three groups of 4
    assert prompts_per_micro_batch(7, 3) == 3  # rows 14-20 touch groups 4, 5 and 6 (rows 12-14, 15-17, 18-20)
    assert prompts_per_micro_batch(3, 1) == 3  # G = 1: nothing shared


def test_ppo_counts_the_critic_body_head_and_adamw_states_and_its_own_update_phase():
    # The critic is the body without the LM head + a hidden -> 1 head, trained in fp32: 4 B weights + 8 B AdamW
    # held through every phase (12 B/param), its 4 B gradients only in its own update (after the policy's).
    gae = ["algorithm.advantage_estimator=gae", "loss.scale_rewards=null"]
    plain = estimate("loss.scale_rewards=null")
    assert plain.per_device_gb["critic"] == 0 and "critic_update" not in plain.phases_gb
    tied = estimate(*gae)  # Qwen2.5-3B ties its LM head to the embeddings: the body is every parameter
    body_3b = 3_085_938_688 + 2048 + 1
    assert tied.per_device_gb["critic"] == pytest.approx(body_3b * 12 / GIB, abs=0.001)
    assert tied.phases_gb["update"] == pytest.approx(plain.phases_gb["update"] + body_3b * 12 / GIB, abs=0.002)
    assert tied.phases_gb["critic_update"] > tied.phases_gb["update"] - plain.phases_gb["update"] + body_3b * 4 / GIB
    # Qwen2.5-7B's LM head is separate (152064 x 3584): the critic leaves it out.
    untied = estimate(*gae, "critic.name_or_path=Qwen/Qwen2.5-7B-Instruct")
    body_7b = 7_615_616_512 - 152064 * 3584 + 3584 + 1
    assert untied.per_device_gb["critic"] == pytest.approx(body_7b * 12 / GIB, abs=0.001)
    # A LoRA critic keeps its frozen body in the policy's bf16 and trains only the adapters (+ the head).
    lora = estimate(*gae, "critic.lora_r=16").per_device_gb["critic"]
    assert 3_085_938_688 * 2 / GIB < lora < tied.per_device_gb["critic"] / 4
    assert "critic" in format_table(tied)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_critic_states_equal_the_real_value_models_weights_and_adamw_states(tiny_model_dir, lora_r):
    # The estimate's parameter counts against a loaded grpo.critic.ValueModel after one AdamW step
    # (fp32 here: weights 4 B, m and v 4 B each per trained parameter; frozen LoRA body 4 B).
    from grpo.critic.value_model import load_value_model
    from grpo.commands.memory.critic import critic_memory

    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", "algorithm.advantage_estimator=gae",
                             "loss.scale_rewards=null", f"critic.lora_r={lora_r}"])
    model = load_value_model(cfg.critic, cfg.model, torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(3, 100, (1, 5))
    model(ids, torch.ones_like(ids), torch.arange(5)[None]).sum().backward()
    optimizer.step()
    real = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    shape = ModelShape.from_config(json.loads((tiny_model_dir / "config.json").read_text()), "tiny")
    est = critic_memory(cfg, policy_shape=shape, gpus=1, attention="sdpa")
    assert est.states == real
    assert est.gradients == sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("extra", [[], ["model.lora_r=16"], ["model.gradient_checkpointing=false"]])
def test_the_ptx_micro_batch_costs_what_a_policy_micro_batch_of_its_shape_does(extra):
    # A policy micro-batch of 4 one-token prompts with 511-token completions, one per prompt (gae: no shared
    # prompt pass), is 4 whole 512-token sequences with logits at each position but the first: the PTX
    # micro-batch of 4 pairs of ptx.max_length 512 (its default here) has that shape, so its phase must
    # equal the update's (the same model states and gradients around them).
    shape = ["data.max_prompt_length=1", "rollout.max_completion_length=511", "rollout.num_generations=1",
             "algorithm.advantage_estimator=gae", "train.prompts_per_step=4", "train.micro_batch_size=4"]
    plain = estimate(*shape, *extra)
    ptx = estimate(*shape, *extra, "ptx.data=sft.jsonl", "ptx.micro_batch_size=4")
    assert "ptx_update" not in plain.phases_gb
    assert ptx.phases_gb["ptx_update"] == pytest.approx(ptx.phases_gb["update"], abs=0.002)
    assert {k: v for k, v in ptx.phases_gb.items() if k != "ptx_update"} == plain.phases_gb
    bigger = estimate(*shape, *extra, "ptx.data=sft.jsonl", "ptx.micro_batch_size=16")
    assert bigger.phases_gb["ptx_update"] > ptx.phases_gb["ptx_update"] + 0.5
    assert any("PTX micro-batch: 16 x 512 tokens" in n for n in bigger.notes)


def test_token_budget_and_packing_size_the_update_as_the_passes_run_it():
    # seed: 256 + 512 = 768 tokens per full-length row, micro-batch 4; a 1,600-token budget holds 2 such rows
    whole = estimate("model.lora_r=16", "train.fused_lm_head=false")
    budget = estimate("model.lora_r=16", "train.fused_lm_head=false", "train.max_tokens_per_micro_batch=1600")
    two_rows = estimate("model.lora_r=16", "train.fused_lm_head=false", "train.micro_batch_size=2")
    assert budget.per_device_gb["activations"] == two_rows.per_device_gb["activations"]
    assert budget.per_device_gb["logits"] == two_rows.per_device_gb["logits"] < whole.per_device_gb["logits"]
    assert any("at most 2 full-length rows" in n for n in budget.notes)
    one_row = estimate("model.lora_r=16", "train.max_tokens_per_micro_batch=10")  # a row over the budget runs alone
    assert one_row.per_device_gb == estimate("model.lora_r=16", "train.micro_batch_size=1").per_device_gb
    # packed rows run their own prompts: no shared prompt pass in the activations; each sdpa layer keeps one
    # block-diagonal mask over the 4 x 768 packed tokens (bf16) instead of each row's own 768 x 768 one
    no_gc = ("model.lora_r=16", "model.gradient_checkpointing=false")  # checkpointing would rule sharing out anyway
    packed = estimate(*no_gc, "train.pack_sequences=true")
    plain = estimate(*no_gc, "train.shared_prompt_pass=false")
    wider_masks = 36 * 2 * (4 * 768) * (3 * 768) / GIB  # Qwen2.5-3B's 36 layers, all of them adapted
    assert packed.per_device_gb["activations"] == pytest.approx(plain.per_device_gb["activations"] + wider_masks,
                                                                abs=0.002)
    assert packed.per_device_gb["activations"] != estimate(*no_gc).per_device_gb["activations"]  # shared
