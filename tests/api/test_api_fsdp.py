"""FSDP as a TRL user asks for it (``grpo.api.fsdp_arguments``): ``GRPOConfig(fsdp=..., fsdp_config=...)`` read as
transformers' TrainingArguments reads them, both ways through the mapping; ``accelerate launch`` with an accelerate
config file of ``distributed_type: FSDP``, ``fsdp_version: 2`` (its environment, which Trainer's Accelerator
reads); what grpo's FSDP2 cannot do refused naming the argument; and README's TRL quick start under ``accelerate
launch`` with such a file, on two CPU ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.api import GRPOConfig
from grpo.api.fsdp_arguments import fsdp_keys, launcher_fsdp, with_launcher_fsdp

REPO = Path(__file__).resolve().parents[2]
BASE = {"use_cpu": True, "max_steps": 2}


@pytest.mark.parametrize("fsdp, config, keys", [
    (True, None, {"train.fsdp": True}),
    ("full_shard auto_wrap", None, {"train.fsdp": True, "fsdp.reshard_after_forward": True}),
    (["shard_grad_op", "offload"], None, {"train.fsdp": True, "fsdp.reshard_after_forward": False,
                                          "fsdp.cpu_offload": True}),
    (True, {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer", "fsdp_offload_params": "true",
            "state_dict_type": "SHARDED_STATE_DICT", "activation_checkpointing": True},
     {"train.fsdp": True, "fsdp.cpu_offload": True, "fsdp.layer_classes": ["Qwen2DecoderLayer"],
      "model.gradient_checkpointing": True}),
    (None, {"version": 2}, {}),  # fsdp off: its config is not read (as transformers)
])
def test_trainingarguments_fsdp_and_fsdp_config_as_grpo_keys(fsdp, config, keys):
    assert fsdp_keys(fsdp, config) == keys


def test_fsdp_config_may_be_a_json_file_and_the_mapping_runs_both_ways(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                "fsdp_transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}))
    cfg = GRPOConfig(fsdp=True, fsdp_config=str(path), gradient_checkpointing=False, **BASE).to_run_config()
    assert cfg.train.fsdp and not cfg.fsdp.reshard_after_forward and cfg.fsdp.layer_classes == ["Qwen2DecoderLayer"]
    cfg = GRPOConfig(fsdp=True, grpo_overrides={"fsdp.reduce_dtype": "bfloat16"}, **BASE).to_run_config()
    back = GRPOConfig.from_run_config(cfg)
    assert back.fsdp is True and back.fsdp_config["version"] == 2
    assert back.grpo_overrides == {"fsdp.reduce_dtype": "bfloat16"}  # a key TRL has no name for
    assert back.to_run_config() == cfg
    assert not GRPOConfig(**BASE).to_run_config().train.fsdp


@pytest.mark.parametrize("fsdp, config, message", [
    (True, {"version": 1}, "version 1 is not supported: grpo runs FSDP2"),
    ("hybrid_shard", None, "hybrid_shard is not supported: grpo's FSDP2 shards over all ranks"),
    (True, {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}, "auto_wrap_policy SIZE_BASED_WRAP"),
    (True, {"mixed_precision_policy": "bf16"}, r"keys \['mixed_precision_policy'\] are not known"),
    (True, {"xla": True}, "xla is not supported"),
    (True, {"cpu_offload": "sometimes"}, "is not a true/false value"),
])
def test_what_grpos_fsdp2_cannot_do_is_refused_naming_the_argument(fsdp, config, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(fsdp=fsdp, fsdp_config=config, **BASE).to_run_config()


ACCELERATE = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "false",
              "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
              "FSDP_TRANSFORMER_CLS_TO_WRAP": "Qwen2DecoderLayer", "FSDP_MIN_NUM_PARAMS": "100000000.0",
              "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_ACTIVATION_CHECKPOINTING": "false"}


def test_accelerate_launchs_fsdp_environment_is_read_unless_the_arguments_say_fsdp():
    args = with_launcher_fsdp(GRPOConfig(**BASE), ACCELERATE)
    cfg = args.to_run_config()
    assert cfg.train.fsdp and cfg.fsdp.layer_classes == ["Qwen2DecoderLayer"] and not cfg.fsdp.cpu_offload
    given = GRPOConfig(fsdp="full_shard offload", **BASE)
    assert with_launcher_fsdp(given, ACCELERATE) is given  # TrainingArguments' fsdp wins, as Trainer's plugin
    assert launcher_fsdp({"FSDP_VERSION": "2"}) is None  # no ACCELERATE_USE_FSDP: not an FSDP launch
    # accelerate writes FSDP_VERSION 1 when the file has no fsdp_version
    without_version = {k: v for k, v in ACCELERATE.items() if k != "FSDP_VERSION"}
    with pytest.raises(ValueError, match=r"accelerate launch's FSDP config .*version 1 .*fsdp_version: 2"):
        with_launcher_fsdp(GRPOConfig(**BASE), without_version)


ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
machine_rank: 0
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


def _quick_start(output_dir: Path) -> str:
    """README's snippet, fewer and shorter steps, reporting what the trainer ran."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("```python", readme.index("<!-- snippet: run -->")) + len("```python\n")
    snippet = readme[start:readme.index("```", start)]
    snippet = snippet.replace('output_dir="runs/quickstart", max_steps=4, per_device_train_batch_size=16',
                              f'output_dir="{output_dir}", max_steps=2, per_device_train_batch_size=8')
    snippet = snippet.replace("max_completion_length=64", "max_completion_length=16, save_steps=1")
    assert "max_steps=2" in snippet and "save_steps=1" in snippet
    # A file, not stdout: under torchrun the ranks' unbuffered prints interleave mid-line in the one pipe
    return snippet + ("\nimport os, json\nif os.environ['RANK'] == '0':\n    open(os.path.join(args.output_dir, "
                      "'ran.json'), 'w').write(json.dumps({'fsdp': trainer.config.train.fsdp, 'ranks': "
                      "trainer.num_processes, 'layers': trainer.config.fsdp.layer_classes}))\n")


@pytest.mark.slow
@pytest.mark.integration
def test_the_trl_quick_start_under_accelerate_launch_with_an_fsdp2_config_file(tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    if not accelerate.exists():
        pytest.skip("accelerate's command is not installed")
    (tmp_path / "fsdp2.yaml").write_text(ACCELERATE_CONFIG)
    (tmp_path / "quick.py").write_text(_quick_start(tmp_path / "out"))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    # from the repository: the snippet names the shipped model by its relative path
    result = subprocess.run([str(accelerate), "launch", "--config_file", str(tmp_path / "fsdp2.yaml"),
                             "--main_process_port", str(_free_port()), str(tmp_path / "quick.py")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert json.loads((out / "ran.json").read_text()) == {"fsdp": True, "ranks": 2, "layers": ["Qwen2DecoderLayer"]}
    assert {p.name for p in out.iterdir()} >= {"checkpoint-1", "checkpoint-2", "fsdp-step-1", "fsdp-step-2"}
    assert sorted(p.name for p in (out / "fsdp-step-2").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def _free_port() -> int:
    from transport_helpers import free_port

    return free_port()


def test_save_model_and_evaluate_after_an_fsdp_train_point_to_final_and_export(monkeypatch):
    import torch

    import grpo.parallel.fsdp as fsdp
    from grpo.api.fsdp_arguments import refuse_shards

    model = torch.nn.Linear(2, 2)
    refuse_shards(model, "save_model()")  # not sharded: nothing to refuse
    monkeypatch.setitem(fsdp._RESHARD, model, False)  # as shard() records a root
    with pytest.raises(ValueError, match=r"save_model\(\) after train\(\) with FSDP: .*save_final_model=True"):
        refuse_shards(model, "save_model()")
