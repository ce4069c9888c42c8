"""Every field of TRL 1.16's ``GRPOConfig`` has one place in grpo's table (``grpo.api.trl_fields``): linked to grpo
config keys both ways, read by the trainer itself, accepted as it is (it cannot change what a run computes), or
refused, and only the short list may be refused (uploads to the Hub; what needs several GPUs or a constrained decoder
grpo has not built; the vLLM server mode, whose refusal names the command that runs the same setup). A linked or
read field is named by a test of its own."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from grpo.api.arguments import GRPOConfig
from grpo.api.trl_fields import ACCEPTED_AS_IS, LINKS, READ_BY_THE_TRAINER, UNSUPPORTED

trl = pytest.importorskip("trl")
TESTS = Path(__file__).resolve().parents[1]
TRL_FIELDS = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
LINKED = {name for link in LINKS for name in link.args}
# (field: why it may stay refused) the short list; anything else refused is a field grpo owes its users
MAY_BE_REFUSED = {
    "push_to_hub": "the Hub", "log_completions_hub_repo": "the Hub",
    "vllm_tensor_parallel_size": "several GPUs", "parallelism_config": "several GPUs (tensor/context parallel)",
    "vllm_mode": "its refusal prints the command of grpo's decoupled mode",
    "vllm_structured_outputs_regex": "constrained decoding, not built",
    "auto_find_batch_size": "TRL refuses it too",
}


def test_every_trl_field_has_exactly_one_place():
    places = {"linked": LINKED, "read by the trainer": set(READ_BY_THE_TRAINER), "accepted as is": set(ACCEPTED_AS_IS),
              "refused": set(UNSUPPORTED)}
    for name in sorted(TRL_FIELDS):
        where = [place for place, names in places.items() if name in names]
        assert len(where) == 1, f"TRL's GRPOConfig.{name} is {where or 'nowhere'} in grpo.api.trl_fields"
    assert not (LINKED | set(READ_BY_THE_TRAINER)) - {f.name for f in dataclasses.fields(GRPOConfig)}


# (TRL field, value, grpo key, what the key becomes): the fields no other test names, each set and read back
SETS = [
    ("cast_lm_head_to_fp32", True, "model.lm_head_fp32", True),
    ("neftune_noise_alpha", 5.0, "model.neftune_noise_alpha", 5.0),
    ("model_init_kwargs", {"attn_implementation": "eager"}, "model.attn_implementation", "eager"),
    ("trust_remote_code", True, "model.trust_remote_code", True),
    ("vllm_enable_sleep_mode", True, "rollout.vllm_enable_sleep_mode", True),
    ("vllm_importance_sampling_mode", "token_truncate", "loss.sampler_is_mode", "token_truncate"),
    ("vllm_importance_sampling_clip_max", 2.0, "loss.sampler_is_cap", 2.0),
    ("vllm_importance_sampling_clip_min", 0.5, "loss.sampler_is_min", 0.5),
    ("vllm_importance_sampling_cap", 4.0, "loss.sampler_is_cap", 4.0),  # TRL's deprecated name wins where given
]


@pytest.mark.parametrize("field, value, key, expected", SETS, ids=[row[0] for row in SETS])
def test_each_field_sets_its_key_and_reads_back(field, value, key, expected):
    from operator import attrgetter

    args = GRPOConfig(max_steps=1, use_cpu=True, **{field: value})
    cfg = args.to_run_config()
    assert attrgetter(key)(cfg) == expected
    assert GRPOConfig.from_run_config(cfg).to_run_config() == cfg


def test_only_the_short_list_is_refused_and_each_refusal_says_what_to_do():
    assert set(UNSUPPORTED) <= set(MAY_BE_REFUSED), sorted(set(UNSUPPORTED) - set(MAY_BE_REFUSED))
    for name, (default, why) in UNSUPPORTED.items():
        assert getattr(trl.GRPOConfig, name, default) == default or name in ("parallelism_config",), name
        assert len(why) > 30, (name, why)


TEST_TEXT = "\n".join(path.read_text(encoding="utf-8") for path in sorted(TESTS.rglob("*.py")))  # SETS above too


def _named_in_a_test(name: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", TEST_TEXT) is not None


@pytest.mark.parametrize("name", sorted(TRL_FIELDS & (LINKED | set(READ_BY_THE_TRAINER))))
def test_a_linked_or_read_field_is_named_by_a_test_of_its_own(name):
    assert _named_in_a_test(name), f"no test names TRL's {name} (grpo.api.trl_fields links it)"
