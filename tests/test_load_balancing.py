"""The MoE load-balancing loss (``loss.router_aux_loss_coef``, TRL 1.16's ``router_aux_loss_coef``): the pure
function against transformers' own ``load_balancing_loss_func`` and a hand-computed case, the update's term with
TRL's scaling under gradient accumulation, the coefficient's resolution, and the router-logits switch."""

from __future__ import annotations

import importlib

import pytest
import torch
from architectures import FAMILIES
from step_helpers import RecordingLearner, random_batch, settings_with

from grpo.algorithm import load_balancing_loss
from grpo.config import ConfigError
from grpo.models.moe import RouterLoss, router_logits_off, router_loss
from grpo.parallel.distributed import DistInfo
from grpo.step.logprobs import completion_logprobs
from grpo.step.policy_update import train_on_batch
from grpo.step.update_inputs import prepare_batch

# The families whose transformers modules define load_balancing_loss_func (Switch-style routers)
WITH_AUX = [module for module in ("mixtral", "qwen3_moe", "gpt_oss", "ernie4_5_moe", "qwen2_moe", "olmoe")
            if importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}") is not None]


@pytest.mark.parametrize("module", WITH_AUX)
@pytest.mark.parametrize("masked", [False, True])
def test_the_loss_is_transformers_load_balancing_loss_func(module, masked):
    theirs = importlib.import_module(f"transformers.models.{module}.modeling_{module}").load_balancing_loss_func
    g = torch.Generator().manual_seed(0)
    b, T, E, k, layers = 3, 7, 8, 2, 4
    logits = tuple(torch.randn(b * T, E, generator=g) * 2 for _ in range(layers))
    mask = (torch.rand(b, T, generator=g) > 0.3).long() if masked else None
    want = theirs(logits, E, k, mask)
    got = load_balancing_loss(logits, k, mask)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def test_a_hand_computed_case():
    # Two experts, top-1, one layer. Token a: probs (0.75, 0.25) -> expert 0; token b: (0.25, 0.75) -> expert 1.
    # f = (1/2, 1/2), P = (1/2, 1/2): E x sum f P = 2 x (1/4 + 1/4) = 1, the balanced minimum.
    a, b = torch.log(torch.tensor([0.75, 0.25])), torch.log(torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(load_balancing_loss([torch.stack([a, b])], 1), torch.tensor(1.0))
    # Both tokens on expert 0: f = (1, 0), P = (3/4, 1/4): 2 x 3/4 = 1.5.
    torch.testing.assert_close(load_balancing_loss([torch.stack([a, a])], 1), torch.tensor(1.5))
    # Token b weighted 0 (padding): token a alone, f = (1, 0), P = (3/4, 1/4): 1.5 again.
    torch.testing.assert_close(load_balancing_loss([torch.stack([a, b])], 1, torch.tensor([1.0, 0.0])),
                               torch.tensor(1.5))


def test_integer_weights_are_the_tokens_repeated_and_only_the_probabilities_carry_gradient():
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(5, 6, generator=g, requires_grad=True) for _ in range(3)]
    weights = torch.tensor([1.0, 3.0, 0.0, 2.0, 1.0])
    repeat = weights.long()
    weighted = load_balancing_loss(logits, 2, weights)
    repeated = load_balancing_loss([x.repeat_interleave(repeat, 0) for x in logits], 2)
    torch.testing.assert_close(weighted, repeated, atol=0, rtol=1e-6)
    weighted.backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in logits)
    assert all(torch.equal(x.grad[2], torch.zeros(6)) for x in logits)  # a weight-0 token has no gradient


@pytest.fixture(scope="module")
def mixtral(tiny_tokenizer):
    if not FAMILIES["mixtral"].available():
        pytest.skip("this transformers has no Mixtral")
    return FAMILIES["mixtral"].build(tiny_tokenizer).train()


def test_the_update_adds_coef_times_each_micro_batchs_loss_weighted_by_its_rows(mixtral):
    """TRL adds coef x aux / gradient_accumulation_steps per micro-batch; grpo weights each by its share of the
    update's rows (the same for equal micro-batches): the gradient is that of policy loss + coef x the mean aux."""
    batch = random_batch(mixtral.config.vocab_size, N=6)
    plain, routed = settings_with(micro_batch_size=3), settings_with(micro_batch_size=3, router=RouterLoss(0.5, 2))
    without, with_aux = RecordingLearner(mixtral), RecordingLearner(mixtral)
    dist = DistInfo()
    train_on_batch(without, batch, plain, dist)
    stats = train_on_batch(with_aux, batch, routed, dist)
    gen = batch.generation
    micro_batches = [rows for rows, _ in prepare_batch(batch, routed, dist, torch.device("cpu")).micro_batches]
    assert [len(rows) for rows in micro_batches] == [3, 3]
    auxes = [completion_logprobs(mixtral, gen.prompt_ids[r], gen.prompt_mask[r], gen.completion_ids[r],
                                 gen.completion_mask[r], 0.9, router_top_k=2)[2] for r in micro_batches]
    mixtral.zero_grad(set_to_none=True)
    (0.5 * (auxes[0] + auxes[1]) / 2).backward()
    for name, p in mixtral.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(with_aux.grads[0][name] - without.grads[0].get(name, 0), p.grad,
                                       atol=1e-6, rtol=1e-4, msg=name)
    assert stats.totals["moe/aux_loss"] == pytest.approx(float(sum(auxes).detach()) / 2, rel=1e-6)
    assert "moe/aux_loss" not in train_on_batch(RecordingLearner(mixtral), batch, plain, dist).totals


def test_the_coefficient_resolves_as_trls(mixtral, tiny_tokenizer):
    """null: the config's router_aux_loss_coef; 0: off; a value: it. A dense model: none, and a non-zero value
    for it (or for DeepSeek-V3, which balances by a routing bias) is refused naming the key."""
    assert router_loss(mixtral, None) == RouterLoss(coef=mixtral.config.router_aux_loss_coef, top_k=2)
    assert router_loss(mixtral, 0.0) is None
    assert router_loss(mixtral, 0.02) == RouterLoss(coef=0.02, top_k=2)
    dense = FAMILIES["llama"].build(tiny_tokenizer)
    assert router_loss(dense, None) is None and router_loss(dense, 0.0) is None
    with pytest.raises(ConfigError, match=r"loss\.router_aux_loss_coef: 0\.01 is set, but LlamaForCausalLM"):
        router_loss(dense, 0.01)


def test_a_checkpoint_saved_with_router_logits_on_still_samples_and_shares_prompts(mixtral, tiny_tokenizer):
    """A config with output_router_logits: true (as a trainer may save it) makes every forward compute
    transformers' own aux loss over its attention mask, which a cached forward's routed tokens do not match;
    grpo turns it off at load and asks for the router logits itself."""
    from grpo.rollout.engine import SamplingParams
    from grpo.rollout.lean import LeanEngine

    model = FAMILIES["mixtral"].build(tiny_tokenizer)
    model.config.output_router_logits = True
    rows = random_batch(model.config.vocab_size, N=4).generation
    shared = (rows.prompt_ids[[0, 0, 1, 1]], rows.prompt_mask[[0, 0, 1, 1]], rows.completion_ids, rows.completion_mask)
    with pytest.raises(RuntimeError, match="must match the size"):
        completion_logprobs(model, *shared, 1.0, share_prompts=True)
    router_logits_off(model)
    assert model.config.output_router_logits is False
    completion_logprobs(model, *shared, 1.0, share_prompts=True)
    LeanEngine(model, tiny_tokenizer).generate_ids([[5, 6, 7]], SamplingParams(n=2, max_tokens=3))
