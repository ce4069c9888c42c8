"""The config -> rollout engine factory: hf engines by name, and a clear config error for vLLM where it
is not installed (raised before a run writes anything)."""

from __future__ import annotations

import importlib.util

import pytest

from grpo.config import ConfigError, load_config
from grpo.models.tiny import build_qwen2, build_tokenizer
from grpo.rollout import HFEngine, LeanEngine, StaticEngine
from grpo.rollout.build import ENGINES, build_engine, check_engine_available, holds_own_weights


def test_hf_engines_by_name_sample_from_the_policy_itself():
    tokenizer = build_tokenizer()
    model = build_qwen2(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    for name, kind in (("hf", LeanEngine), ("hf-static", StaticEngine), ("hf-generate", HFEngine)):
        engine = build_engine(load_config(None, [f"rollout.engine={name}"]), model, tokenizer)
        assert isinstance(engine, kind) and not holds_own_weights(engine)
        assert not ENGINES[name].traits.own_weights


def test_auto_engine_is_hf_static_on_cuda_and_hf_elsewhere():
    from grpo.config.device_defaults import resolve_engine_name

    assert resolve_engine_name("auto", "cuda") == "hf-static"
    assert resolve_engine_name("auto", "cpu") == resolve_engine_name("auto", "mps") == "hf"
    # where hf-static cannot run: a 4-bit base, sliding-window layers
    assert resolve_engine_name("auto", "cuda", quantized=True) == "hf"
    assert resolve_engine_name("auto", "cuda", full_attention=False) == "hf"
    assert resolve_engine_name("auto", "cuda", sharded=True) == "hf"  # ZeRO-3
    assert resolve_engine_name("hf-generate", "cuda") == "hf-generate"  # a named engine is kept as named
    tokenizer = build_tokenizer()
    model = build_qwen2(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cfg = load_config(None, [])
    assert cfg.rollout.engine == "auto" and isinstance(build_engine(cfg, model, tokenizer), LeanEngine)  # a CPU model


def test_auto_engine_reads_the_policys_device_and_layers(monkeypatch):
    from grpo.rollout.build import policy_engine_name

    tokenizer = build_tokenizer()
    model = build_qwen2(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cfg = load_config(None, [])
    monkeypatch.setattr(model.config, "layer_types", ["full_attention", "full_attention"])
    assert policy_engine_name(cfg, model) == "hf"  # on the CPU
    meta = build_qwen2(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=64).to("meta")  # a device type other than the CPU's, without a GPU
    import grpo.rollout.build as build

    seen = []
    monkeypatch.setattr(build, "resolve_engine_name",
                        lambda name, device, **kw: seen.append((name, device, kw)) or "hf")
    meta.config.layer_types, meta.config.sliding_window = ["full_attention", "sliding_attention"], 8
    build.policy_engine_name(cfg, meta)
    assert seen == [("auto", "meta", {"quantized": False, "full_attention": False, "sharded": False})]
    # Mistral v0.1's config: no layer_types, a sliding window on every layer (read off the cache it builds)
    meta.config.layer_types = None
    build.policy_engine_name(cfg, meta)
    assert seen[-1][2]["full_attention"] is False
    meta.config.sliding_window = None
    build.policy_engine_name(cfg, meta)
    assert seen[-1][2]["full_attention"] is True
    next(meta.parameters()).ds_id = 0  # how DeepSpeed ZeRO-3 marks the parameters it partitions
    build.policy_engine_name(cfg, meta)
    assert seen[-1][2]["sharded"] is True


def test_the_config_offers_exactly_the_registered_engines():
    from dataclasses import fields

    from grpo.config.schema import RolloutConfig

    engine = next(f for f in fields(RolloutConfig) if f.name == "engine")
    assert set(engine.metadata["choices"]) == {"auto", *ENGINES} and engine.default == "auto"
    assert [n for n, k in ENGINES.items() if k.traits.own_weights] == ["vllm"]


def test_an_engine_with_update_weights_is_an_own_weights_engine():
    from grpo.rollout import OwnWeightsEngine

    class Pushed:
        def generate(self, prompts, params, seed=None): ...

        def update_weights(self, weights) -> None: ...

    class Plain:
        def generate(self, prompts, params, seed=None): ...

    assert isinstance(Pushed(), OwnWeightsEngine) and holds_own_weights(Pushed())
    assert not holds_own_weights(Plain())


def test_a_wrapper_has_only_its_own_abilities_its_engines_are_asked_of_the_engine():
    """A multi-turn or hook wrapper forwards nothing: asked of the wrapper, the vLLM-like engine's abilities
    would be guessed; ``sampling_engine`` names the engine that has them."""
    from grpo.multiturn.driver import sampling_engine
    from grpo.multiturn.rollout_hook import RolloutHook

    class Pushed:
        def generate(self, prompts, params, seed=None): ...

        def update_weights(self, weights) -> None: ...

    engine = Pushed()
    hook = RolloutHook(lambda prompts, context: {}, engine, tokenizer=None, eos_ids=[0])
    assert not holds_own_weights(hook) and not hasattr(hook, "update_weights")
    assert sampling_engine(hook) is engine and holds_own_weights(sampling_engine(hook))
    assert sampling_engine(engine) is engine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_vllm_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout.engine: vllm: vLLM is not installed: "
                                          r"`pip install 'grpo\[vllm\]'`"):
        check_engine_available(load_config(None, ["rollout.engine=vllm"]))


def test_an_untested_vllm_release_is_refused_naming_the_tested_ones(monkeypatch):
    # A stand-in `vllm` module: the version check runs before anything else of vLLM is touched.
    import sys
    import types

    from grpo.rollout.vllm_engine import TESTED_VLLM

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0"))
    with pytest.raises(ConfigError, match=r"vLLM 0\.33\.0 is installed, but .* tested with vLLM "
                                          r"0\.24\.0, 0\.25\.1, 0\.26\.0 \(torch 2\.11\.0\); "
                                          r"0\.27\.1, .*, 0\.32\.0 \(torch 2\.13\.0\) only"):
        check_engine_available(load_config(None, ["rollout.engine=vllm"]))
    # an untested patch after a tested one, and one before (0.25.0: the extra leaves it out too)
    for untested in ("0.32.1", "0.25.0"):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=untested))
        with pytest.raises(ConfigError, match=rf"vLLM {untested} is installed"):
            check_engine_available(load_config(None, ["rollout.engine=vllm"]))
    for release in (*TESTED_VLLM, "0.32.0+cu130"):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=release))
        check_engine_available(load_config(None, ["rollout.engine=vllm"]))  # a tested release passes


def test_the_vllm_extra_admits_the_tested_releases_and_not_the_untested_ones():
    # pyproject's `vllm` extra and TESTED_VLLM must agree: pip should not install a release the engine refuses.
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    from grpo.rollout.vllm_engine import TESTED_VLLM

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (extra,) = pyproject["project"]["optional-dependencies"]["vllm"]
    specifier = Requirement(extra).specifier
    assert all(specifier.contains(release) for release in TESTED_VLLM)
    # the index's other releases around the tested ones: superseded patches, the next minor, the one before
    for untested in ("0.23.0", "0.25.0", "0.27.0", "0.33.0"):
        assert untested not in TESTED_VLLM and not specifier.contains(untested)


@pytest.mark.parametrize("overrides, in_process", [
    ([], False),
    (["decoupled.weight_update=in_flight"], True),  # grpo steps the engine core to load weights between steps
    (["decoupled.partial_rollouts=true", "train.max_staleness=1"], True),  # and to record each token's version
])
def test_a_vllm_sampler_runs_its_engine_core_in_process_when_it_records_per_token(monkeypatch, overrides,
                                                                                   in_process):
    import grpo.rollout.build as build

    built = {}
    monkeypatch.setattr(build, "VLLMEngine", lambda *args, **kwargs: built.update(kwargs))
    cfg = load_config(None, ["rollout.engine=vllm", "train.mode=decoupled", *overrides])
    build._build_vllm(cfg, policy=None, tokenizer=None)
    assert built["in_flight"] is in_process
