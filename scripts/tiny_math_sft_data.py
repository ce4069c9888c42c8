"""The SFT data of the tiny-math build (``scripts/build_tiny_math_model.py``, whose header says what is
built and why): word problems rendered as the trainer renders them with their target completions (some
multi-step chains planted to stop after the first step), bare arithmetic chains labelled only where
they are determined, the prompt prefix every row shares, the tokenizer's training text, and the
tokenizer with the answer tags as ordinary tokens.

``settings`` is the build's ``BuildSettings`` (seed, mix, planted_fraction, batch sizes, bare_style,
tokenizer_problems, system_prompt)."""

from __future__ import annotations

import json
import random
import re

from grpo.data import Example, generate_problems, render_example
from grpo.data.synthetic import MIXES, solution_chain
from grpo.models.tiny import TAG_TOKENS, build_tokenizer

TAG_STYLE = "think"
PLANTED_FRACTION = 0.6  # share of multi-step SFT examples whose chain stops after the first step
HELD_OUT_SEED = 123  # the held-out set's seed (configs/demo-cpu.yaml data.eval); never trained on
BARE_CHAINS_PER_ROW = 4
EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def equations(example: Example) -> list[str]:
    """The bare equations of an example's worked solution, one per step ("12 + 7 = 19")."""
    return ["{} {} {} = {}".format(*EQUATION.search(line).groups()) for line in example.solution.split("\n")]


def completion_text(chain: list[str], answer: str) -> str:
    """The target completion (before EOS): the chain inside <think>, the number inside <answer>."""
    return "<think>\n" + "\n".join(chain) + "\n</think>\n<answer>\n" + answer + "\n</answer>"


def sft_completion(example: Example, rng: random.Random, planted_fraction: float) -> tuple[str, bool]:
    """The completion an example is trained on, and whether it is a planted early stop.

    A multi-step example stops after its first step (answering that intermediate number) with
    probability ``planted_fraction``; one-step examples are always complete.
    """
    chain = equations(example)
    if len(chain) > 1 and rng.random() < planted_fraction:
        first = chain[0]
        return completion_text([first], first.split(" = ")[1]), True
    return completion_text(chain, example.answer), False


def training_problem_seed(seed: int, step: int) -> int:
    """Generator seed of one step's problems: 10**6 and up, so never the held-out seed 123."""
    return 1_000_000 + seed * 100_000 + step


def problem_rows(tokenizer, examples: list[Example], rng: random.Random, settings):
    """Prompt + completion + EOS per example as (ids, labels) lists (labels -100 on the prompt), and
    the number of planted early stops. The prompt is tokenized on its own, as the trainer does."""
    prompts = [render_example(tokenizer, e, settings.system_prompt) for e in examples]
    completions, planted = zip(*(sft_completion(e, rng, settings.planted_fraction) for e in examples))
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    rows = []
    for p, c in zip(prompt_ids, completion_ids):
        target = c + [tokenizer.eos_token_id]
        rows.append((p + target, [-100] * len(p) + target))
    return rows, sum(planted)


def bare_chain_text(rng: random.Random, mix: str, style: str = "chain") -> tuple[str, list[tuple[int, int]]]:
    """A chain of bare equations drawn like the mix's problems, and the character spans that are
    determined by what came before.

    style "chain": "28 + 28 = 56\n56 / 7 = 8\n"; determined: each result, each copied left operand.
    style "expression": "28 + 28 / 7\n28 + 28 = 56\n56 / 7 = 8\n"; the flat expression first, then the
    chain, all of which is determined (operands and operators copied from the expression, results
    computed): it practises finding the next number in earlier text and copying it, as a word problem needs.
    """
    level = rng.choice(MIXES[mix])
    steps = rng.randint(1, level.steps)
    chain = solution_chain(rng, steps, level.max_digits)
    text, spans = "", []
    if style == "expression":
        text = " ".join([str(chain[0].left)] + [f"{step.op} {step.right}" for step in chain]) + "\n"
        body = "".join(f"{step.left} {step.op} {step.right} = {step.result}\n" for step in chain)
        return text + body, [(len(text), len(text) + len(body))]
    for index, step in enumerate(chain):
        if index > 0:  # the left operand is the previous result, copied
            spans.append((len(text), len(text) + len(str(step.left))))
        text += f"{step.left} {step.op} {step.right} ="
        start = len(text)
        text += f" {step.result}\n"
        spans.append((start, len(text)))
    return text, spans


def bare_rows(tokenizer, rng: random.Random, settings):
    """``bare_per_step`` bare arithmetic chains, ``BARE_CHAINS_PER_ROW`` packed into each row (short
    rows would be mostly padding), as (ids, labels) lists labelled only inside the determined spans."""
    rows = []
    for _ in range(0, settings.bare_per_step, BARE_CHAINS_PER_ROW):
        text, spans = "", []
        for _ in range(BARE_CHAINS_PER_ROW):
            chain, chain_spans = bare_chain_text(rng, settings.mix, settings.bare_style)
            spans += [(len(text) + s, len(text) + e) for s, e in chain_spans]
            text += chain
        rows.append(span_labelled(tokenizer, text, spans))
    return rows


def span_labelled(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``text``'s ids and labels: a token is labelled (its id) when it starts inside one of the character
    ``spans`` (what the text determines), else -100 (no loss)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if any(s <= start < e for s, e in spans) else -100
              for t, (start, _) in zip(encoded["input_ids"], encoded["offset_mapping"])]
    return encoded["input_ids"], labels


def shared_prompt_prefix(tokenizer, system_prompt: str) -> list[int]:
    """Ids of what every rendered prompt starts with: the system turn and the user turn's opening."""
    probe = Example(messages=[{"role": "user", "content": "\x00"}], answer=None, answer_raw=None, source="probe")
    text = render_example(tokenizer, probe, system_prompt)
    return tokenizer(text[:text.index("\x00")], add_special_tokens=False)["input_ids"]


def tokenizer_corpus(settings) -> list[str]:
    """Text the tokenizer is trained on: rendered prompts (system prompt, question, chat markup), full
    and planted completions, bare equations — everything the model will read or write, in the
    proportions it will see them (seeds disjoint from the held-out set)."""
    rng = random.Random(settings.seed)
    chat_template_only = build_tokenizer()  # renders the prompts; its own vocabulary is not used
    corpus = []
    for example in generate_problems(settings.tokenizer_problems, seed=500_000 + settings.seed, difficulty=settings.mix):
        chain = equations(example)
        corpus += [render_example(chat_template_only, example, settings.system_prompt),
                   completion_text(chain, example.answer),
                   completion_text(chain[:1], chain[0].split(" = ")[1]), bare_chain_text(rng, settings.mix)[0]]
    return corpus


def with_text_tags(tokenizer):
    """The same tokenizer with the answer tags (<think>, </answer>, ...) as ordinary added tokens.

    ``build_tokenizer`` registers them as *special* tokens, and the rollout engine decodes with
    ``skip_special_tokens=True``, which would delete the tags from every completion (format rate 0).
    Qwen's own <think> tokens are likewise added tokens that are not special. Still one token each.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    for added in state["added_tokens"]:
        if added["content"] in TAG_TOKENS:
            added["special"] = False
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = tokenizer.chat_template
    return wrapped
