"""``train.fsdp`` and the ``fsdp`` section: the combinations FSDP2 cannot run are configuration errors naming the
key and why, when the config loads; what only the model can say (its layer classes) fails before the run writes
anything; the settings ``shard`` gets follow model.bf16 and the section."""

from __future__ import annotations

import pytest
import torch

from grpo.config import ConfigError, load_config

BASE = ["train.fsdp=true", "log.report_to=[]"]


@pytest.mark.parametrize("overrides, key, why", [
    (["train.deepspeed=configs/ds_zero2.json"], "train.fsdp", "cannot be combined with train.deepspeed"),
    (["model.lora_r=4", "model.load_in_4bit=true"], "train.fsdp", "bitsandbytes' packed weights"),
    (["optim.optimizer=adamw_8bit"], "train.fsdp", "bitsandbytes' packed weights"),
    (["rollout.engine=vllm"], "train.fsdp", "rollout.engine vllm in colocated mode yet"),
    # its sampling copy was a deepcopy of FSDP2's modules: "FSDP does not support deepcopy" as the run started
    (["rollout.engine=hf-static"], "train.fsdp", "rollout.engine hf-static in colocated mode: its sampling copy"),
])
def test_combinations_fsdp2_cannot_run_name_the_key(overrides, key, why):
    with pytest.raises(ConfigError, match=rf"{key}.*{why}"):
        load_config(None, BASE + overrides)


def test_fsdp_keys_without_train_fsdp_are_refused():
    with pytest.raises(ConfigError, match=r"fsdp.*keys are set but train.fsdp is false"):
        load_config(None, ["fsdp.cpu_offload=true"])
    with pytest.raises(ConfigError, match=r"fsdp.reduce_dtype"):
        load_config(None, BASE + ["fsdp.reduce_dtype=float16"])


def test_a_sharded_trainer_rank_evaluates_with_the_engine_auto_picks_for_it(tiny_tokenizer, monkeypatch):
    # decoupled trainer ranks evaluate over their own (FSDP2-sharded) policy: hf-static's sampling copy cannot be
    # made of it, so they evaluate with hf, as auto picks under FSDP2; the samplers keep hf-static
    from grpo.models.tiny import build_qwen2
    from grpo.rollout import build

    tiny_model = build_qwen2(tiny_tokenizer)
    cfg = load_config(None, BASE + ["train.mode=decoupled", "rollout.engine=hf-static"])
    assert type(build.evaluation_engine(cfg, tiny_model, tiny_tokenizer)).__name__ == "StaticEngine"
    monkeypatch.setattr(build, "is_sharded", lambda model: True)
    assert type(build.evaluation_engine(cfg, tiny_model, tiny_tokenizer)).__name__ == "LeanEngine"
    # where a sharded policy samples itself (ZeRO-3 colocated: the config cannot tell the stage), hf-static is
    # refused by name, not a deepcopy's failure deep in the first rollout
    colocated = load_config(None, ["log.report_to=[]", "rollout.engine=hf-static"])
    with pytest.raises(ConfigError, match="rollout.engine: hf-static samples from a copy.*use rollout.engine hf"):
        build.build_engine(colocated, tiny_model, tiny_tokenizer)


def test_decoupled_vllm_samplers_and_dynamic_sampling_are_allowed():
    # the samplers load published weights; colocated sampling runs on the gathered policy, so ranks may take
    # different numbers of dynamic-sampling rounds (no collective while they sample)
    load_config(None, BASE + ["train.mode=decoupled", "rollout.engine=vllm"])
    load_config(None, BASE + ["rollout.dynamic_sampling=true", "train.max_tokens_per_micro_batch=512"])


def test_shard_settings_follow_bf16_and_the_section():
    from grpo.parallel.trainable import fsdp_settings

    plain = fsdp_settings(load_config(None, BASE))
    assert plain.param_dtype is None and plain.reduce_dtype is None and plain.reshard_after_forward
    bf16 = fsdp_settings(load_config(None, BASE + ["model.bf16=true", "fsdp.reduce_dtype=bfloat16",
                                                    "fsdp.cpu_offload=true", "fsdp.layer_classes=[Qwen2MLP]"]))
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.cpu_offload) == (torch.bfloat16, torch.bfloat16, True)
    assert bf16.layer_classes == ("Qwen2MLP",)


def test_a_model_without_the_layer_classes_fails_before_the_run_writes_anything(tiny_model_dir, tmp_path):
    import torch.distributed as dist

    from grpo.training.colocated import train

    out = tmp_path / "run"
    cfg = load_config(None, BASE + [f"model.name_or_path={tiny_model_dir}", "fsdp.layer_classes=[GPT2Block]",
                                    "data.train=synthetic:seed=1,n=8", "train.prompts_per_step=2",
                                    "rollout.num_generations=2", "train.micro_batch_size=2", "train.device=cpu",
                                    f"train.output_dir={out}", "log.progress_bar=false"])
    with pytest.raises(ConfigError, match=r"^fsdp.layer_classes: no module .*GPT2Block.*Qwen2DecoderLayer"):
        train(cfg)
    assert not out.exists()
    assert not dist.is_initialized()  # refused before a process group was made for the process alone
