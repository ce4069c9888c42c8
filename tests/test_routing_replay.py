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


def test_measuring_without_replay_counts_the_same_mismatch_and_changes_nothing(moe):
    name, model = moe
    ids = _ids(model.config.vocab_size, seed=5)
    with torch.no_grad():
        free = model(input_ids=ids).logits
    E = next(r for r in replay_routers(model)).weight.shape[0]
    layers, k = len(replay_routers(model)), model.config.num_experts_per_tok
    forced = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(20 + i))[:k]
                          for i in range(ids.numel() * layers)]).view(ids.numel(), layers, k)
    measuring = Replaying(model, apply=False)
    with torch.no_grad(), measuring.hooks():
        measuring.feed(forced)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, free, rtol=0, atol=0)  # every forward routed itself
    recording = Recording(model)
    with torch.no_grad(), recording.hooks():
        model(input_ids=ids)
    own = recording.take()
    assert measuring.mismatch == int((own.sort(-1).values != forced.sort(-1).values).any(-1).sum())
    assert measuring.routed == ids.numel() * layers


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


# ---------------------------------------------------------------- the rollout's recording and the log-prob passes


def _sampled(model, tokenizer, seed: int = 1):
    from grpo.rollout.engine import SamplingParams
    from grpo.rollout.lean import LeanEngine

    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3? Answer", "Hi", "Tell me a long story")]
    engine = LeanEngine(model, tokenizer, batch_size=4, record_routing=True)  # two calls: 2 prompts, then 1
    return engine.generate_ids(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0), seed=seed)


PASSES = {"plain": dict(share_prompts=False), "shared prompts": dict(share_prompts=True), "packed": dict(pack=True),
          "micro-batches": dict(share_prompts=True, micro_batch_size=2, column_bucket=1)}


def test_the_rollout_records_every_fed_token_and_each_pass_shape_replays_it(moe, tiny_tokenizer):
    from grpo.step.logprobs import completion_logprobs

    name, model = moe
    g = _sampled(model, tiny_tokenizer)
    layers, k = len(replay_routers(model)), model.config.num_experts_per_tok
    assert g.routing.shape == (6, g.prompt_ids.shape[1] + g.completion_ids.shape[1], layers, k)
    recorded = (g.routing >= 0).all(-1).all(-1)  # [N, T]
    real = torch.cat([g.prompt_mask, g.completion_mask], 1).bool()
    # every real token but each row's last sampled one (drawn, never fed back), nothing else
    last = g.prompt_ids.shape[1] + g.completion_mask.sum(1) - 1
    want = real.clone()
    want[torch.arange(6), last] = False
    assert torch.equal(recorded, want)

    # a sampler whose routers drifted: its recorded experts replayed by the trainer's passes, whatever their shape
    import copy

    drifted = copy.deepcopy(model)
    with torch.no_grad():
        for router in replay_routers(drifted):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3)))
    g = _sampled(drifted, tiny_tokenizer)
    batch = (g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, 1.0)
    mask = g.completion_mask.bool()
    free = completion_logprobs(model, *batch)[mask]
    got = {}
    from grpo.models.architecture import packing_keeps_rows_apart

    for shape, kwargs in PASSES.items():
        if shape == "packed" and not packing_keeps_rows_apart(model):  # refused for it (GPT-OSS)
            continue
        replaying = Replaying(model)
        with torch.no_grad(), replaying.hooks():
            got[shape] = completion_logprobs(model, *batch, routing=g.routing, replaying=replaying, **kwargs)[mask]
        assert replaying.mismatch_fraction() > 0.05 and replaying.unfed == 0, (name, shape)
    for shape, values in got.items():
        torch.testing.assert_close(values, got["plain"], rtol=0, atol=1e-5, msg=(name, shape))
    assert (got["plain"] - free).abs().max() > 1e-3  # replay changed what the trainer computes


def test_joined_and_split_batches_keep_each_rows_routing(tiny_tokenizer):
    from grpo.step.batching import concat_batches, select_groups
    from step_helpers import random_batch

    a, b = random_batch(len(tiny_tokenizer), N=4), random_batch(len(tiny_tokenizer), N=4)
    b.generation.prompt_ids, b.generation.prompt_mask = b.generation.prompt_ids[:, 1:], b.generation.prompt_mask[:, 1:]
    for batch, seed in ((a, 0), (b, 1)):
        g = batch.generation
        T = g.prompt_ids.shape[1] + g.completion_ids.shape[1]
        g.routing = torch.randint(0, 4, (4, T, 2, 2), generator=torch.Generator().manual_seed(seed)).to(torch.int16)
    joined = concat_batches([a, b], pad_id=0)
    assert torch.equal(joined.generation.routing[:4], a.generation.routing)  # a's prompts are the widest
    assert (joined.generation.routing[4:, 0] == -1).all()  # b's prompts left-padded by one column
    assert torch.equal(joined.generation.routing[4:, 1:], b.generation.routing)
    part = select_groups(joined, [1])
    assert torch.equal(part.generation.routing, joined.generation.routing[2:4])  # group 1: rows 2, 3 (G = 2)


def test_routing_replay_is_refused_where_the_routing_is_not_recorded_or_carried():
    from grpo.config import ConfigError, load_config

    for overrides, words in ((["rollout.engine=vllm"], "rollout.engine hf"),
                             (["rollout.engine=hf-static"], "rollout.engine hf"),
                             (["rollout.tools=[calculator]"], "multi-turn"),
                             (["train.fsdp=true"], "train.fsdp")):
        with pytest.raises(ConfigError, match=f"loss.routing_replay .*{words}"):
            load_config(None, ["loss.routing_replay=true", *overrides])
    with pytest.raises(ConfigError, match="log.routing_mismatch needs rollout.engine hf"):
        load_config(None, ["log.routing_mismatch=true", "rollout.engine=vllm"])
    load_config(None, ["loss.routing_replay=true", "rollout.engine=auto"])  # auto picks hf
    load_config(None, ["loss.routing_replay=true", "train.mode=decoupled", "decoupled.partial_rollouts=true",
                       "train.max_staleness=1"])  # the wire and the carry-over carry it


def test_a_dense_policy_with_routing_replay_fails_at_load_naming_the_key(tiny_tokenizer):
    from grpo.config import ConfigError, load_config
    from grpo.models.architecture import check_architecture

    with pytest.raises(ConfigError, match="loss.routing_replay: .*has no Mixture-of-Experts router"):
        check_architecture(load_config(None, ["loss.routing_replay=true"]), FAMILIES["llama"].build(tiny_tokenizer))
