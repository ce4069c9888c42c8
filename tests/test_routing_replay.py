"""grpo.models.routing_replay on the tiny MoE families of the architecture matrix: the recorded experts are the
ones a forward chose; replaying them gives that forward's logits exactly and routes every token to them (checked
by a second hook on the routers); a KV-cache decode recorded and replayed in a full-sequence pass gives the
decode's log-probs where a perturbed router's run, replayed, shows a measurable mismatch; the gradients of a
checkpointed replayed pass equal the plain replayed pass's."""

from __future__ import annotations

import pytest
import torch
from architectures import FAMILIES, MOE_FAMILIES

from grpo.models.routing_replay import Recording, Replaying, replay_routers

FAMILY_NAMES = [name for name in MOE_FAMILIES if FAMILIES[name].available()]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def moe(request, tiny_tokenizer):
    model = FAMILIES[request.param].build(tiny_tokenizer, seed=0).float().eval()
    return request.param, model


def _ids(vocab: int, b: int = 2, t: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _chosen(model) -> tuple[list[torch.Tensor], list]:
    """A second hook after replay's: the experts each router's output finally routes to, per forward."""
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda _m, _a, out: seen.append(out[2].clone())) for r in replay_routers(model)]
    return seen, handles


def test_replaying_a_forwards_own_choice_gives_its_logits_exactly(moe):
    name, model = moe
    ids = _ids(model.config.vocab_size)
    recording = Recording(model)
    with torch.no_grad(), recording.hooks():
        want = model(input_ids=ids).logits
    recorded = recording.take()
    layers = len(replay_routers(model))
    assert recorded.shape == (ids.numel(), layers, model.config.num_experts_per_tok)
    replaying = Replaying(model)
    with torch.no_grad(), replaying.hooks():
        replaying.feed(recorded)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert replaying.routed == ids.numel() * layers and replaying.mismatch_fraction() == 0.0


def test_another_routing_is_replayed_exactly_and_counted_as_mismatch(moe):
    name, model = moe
    ids = _ids(model.config.vocab_size, seed=1)
    recording = Recording(model)
    with torch.no_grad(), recording.hooks():
        model(input_ids=ids)
    own = recording.take()
    E = next(r for r in replay_routers(model)).weight.shape[0]
    forced = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i))[:own.shape[-1]]
                          for i in range(own.shape[0] * own.shape[1])]).view_as(own)
    forced[0] = -1  # the first token keeps its own routing
    replaying = Replaying(model)
    raw, raw_handles = _chosen(model)  # registered before replay's hooks: the routers' own choice in this pass
    with torch.no_grad(), replaying.hooks():
        seen, handles = _chosen(model)  # registered after them: the experts the pass routes to
        try:
            replaying.feed(forced)
            model(input_ids=ids)
        finally:
            for h in handles + raw_handles:
                h.remove()
    routed, raw = torch.stack(seen, dim=1), torch.stack(raw, dim=1)  # [n, layers, k]
    assert torch.equal(routed[1:], forced[1:]) and torch.equal(routed[0], raw[0])
    assert torch.equal(raw[0, 0], own[0, 0])  # the free token's first layer sees unchanged inputs
    # the mismatch is against the pass's own choice (a later layer's depends on the replayed earlier ones)
    differs = (raw[1:].sort(-1).values != forced[1:].sort(-1).values).any(-1)
    assert replaying.mismatch == int(differs.sum()) > 0
    assert replaying.routed == (own.shape[0] - 1) * own.shape[1]


def _decode_logprobs(model, ids: torch.Tensor, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ids[:, prompt:] from a prefill and one-token KV-cache steps (a sampler's passes), and the routing
    of every position but the last (the sampler never feeds its last token: -1 there), as [b * T, layers, k]."""
    scores, routing, recording = [], [], Recording(model)
    k = model.config.num_experts_per_tok
    with torch.no_grad(), recording.hooks():
        out = model(input_ids=ids[:, :prompt], use_cache=True)
        routing.append(recording.take().view(ids.shape[0], prompt, -1, k))
        cache, logits = out.past_key_values, out.logits[:, -1]
        for t in range(prompt, ids.shape[1]):
            scores.append(torch.log_softmax(logits.float(), -1).gather(-1, ids[:, t:t + 1]))
            if t == ids.shape[1] - 1:
                break
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            routing.append(recording.take().view(ids.shape[0], 1, -1, k))
            cache, logits = out.past_key_values, out.logits[:, -1]
    routing = torch.cat(routing, dim=1)
    routing = torch.cat([routing, torch.full_like(routing[:, :1], -1)], dim=1)  # the last token: not fed
    return torch.cat(scores, dim=1), routing.flatten(0, 1)


def _full_logprobs(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, prompt - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, prompt:, None]).squeeze(-1)


def test_a_decode_replayed_in_the_full_pass_gives_the_samplers_logprobs_and_a_perturbed_sampler_a_mismatch(moe):
    name, model = moe
    ids, prompt = _ids(model.config.vocab_size, b=2, t=9, seed=2), 4
    sampler, routing = _decode_logprobs(model, ids, prompt)
    replaying = Replaying(model)
    with torch.no_grad(), replaying.hooks():
        replaying.feed(routing)
        trainer = _full_logprobs(model, ids, prompt)
    torch.testing.assert_close(trainer, sampler.squeeze(-1), rtol=0, atol=1e-5)

    # A sampler whose routers drifted (noise on their weights, as stale or differently computed ones): its routing,
    # replayed by the unperturbed trainer, differs from the trainer's own choice somewhere.
    import copy

    drifted = copy.deepcopy(model)
    with torch.no_grad():
        for router in replay_routers(drifted):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3)))
    _, drifted_routing = _decode_logprobs(drifted, ids, prompt)
    replaying = Replaying(model)
    with torch.no_grad(), replaying.hooks():
        replaying.feed(drifted_routing)
        _full_logprobs(model, ids, prompt)
    assert replaying.mismatch_fraction() > 0.05, name


def test_a_checkpointed_replayed_pass_has_the_plain_replayed_gradients(moe):
    name, model = moe
    ids = _ids(model.config.vocab_size, seed=4)
    E = next(r for r in replay_routers(model)).weight.shape[0]
    layers, k = len(replay_routers(model)), model.config.num_experts_per_tok
    forced = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(10 + i))[:k]
                          for i in range(ids.numel() * layers)]).view(ids.numel(), layers, k)

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        model.zero_grad()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        replaying = Replaying(model)
        try:
            with replaying.hooks():
                replaying.feed(forced)
                model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
        finally:
            model.gradient_checkpointing_disable()
            model.eval()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, checkpointed = grads(False), grads(True)
    assert len(plain) == len(checkpointed) > 0
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_dense_model_has_no_routers_to_replay(tiny_tokenizer):
    with pytest.raises(ValueError, match="has no Mixture-of-Experts router"):
        Recording(FAMILIES["llama"].build(tiny_tokenizer))
