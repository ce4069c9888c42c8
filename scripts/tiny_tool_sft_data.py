"""The SFT data of the tiny-tools build (``scripts/build_tiny_tool_model.py``, whose header says what is built
and why): the compact tool chat template, tiny-math's tokenizer with the tool tokens added, and the training
rows - a prompt rendered with the calculator's schema as the multi-turn driver renders it, then either a
direct answer or a calculator call, its result (context, no loss) and an answer copying it.

``settings`` is the build's ``BuildSettings`` (seed, system_prompt, tool fractions, batch size).
"""

from __future__ import annotations

import json
import random

from grpo.data import Example, build_prompt_messages
from grpo.data.arithmetic_tools import generate_tool_problems, is_large
from grpo.multiturn.calculator import calculator
from grpo.multiturn.conversation import tool_suffix_ids
from grpo.multiturn.tools import tool_schema

TAG_STYLE = "think"
HELD_OUT_SEED = 123  # data.eval of configs/tools-demo-cpu.yaml; training seeds are 10**6 and up

# Qwen2.5's tool format (TRL's qwen2_5.jinja: hermes <tool_call> blocks, tool results as a user turn of
# <tool_response> blocks, prefix-preserving) with a compact tools header: each tool as one line of JSON with
# its name and its parameters' types. The full schema (descriptions included) is ~290 tokens of this
# tokenizer, three times the rest of the prompt, and a 2.5M model reads none of it; the header still
# differs per tool set, and without tools the template renders exactly tiny-math's.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- set ns.start = 1 %}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- '\\n{\"name\": ' + (fn.name | tojson) + ', \"parameters\": {' }}"
    "{%- for key, value in fn.parameters.properties.items() %}"
    "{{- (key | tojson) + ': ' + (value.type | tojson) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '}}' }}"
    "{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.start:] %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Added (not special: decode(skip_special_tokens=True), which the driver parses calls from, keeps them) single
# tokens. The byte-level BPE was trained on math stories and spells JSON one character per token (a call was
# 55 tokens); the markers and the calculator's JSON strings as one token each make a call ~25.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>",
               '"name"', '"arguments"', '"parameters"', '"calculator"', '"expression"', '"string"']


def with_tool_tokens(tokenizer):
    """tiny-math's tokenizer with ``TOOL_TOKENS`` added and the tool chat template; the ids of the new tokens
    (all after the old ones, so every old id keeps its meaning)."""
    from tokenizers import AddedToken

    old = len(tokenizer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer, list(range(old, len(tokenizer)))


def expression(example: Example) -> str:
    """The calculator expression of a one-step problem: its worked solution's left side ("4821 * 37")."""
    return " ".join(example.solution.split(" = ")[0].split()[-3:])


def answer_text(example: Example, after_call: bool = False) -> str:
    """The answering turn: alone, the equation in <think> (as tiny-math writes it) and the result in <answer>;
    after a call, the tool's result in both. (Writing the equation after a call primed the model's own
    arithmetic: a first build with it copied the result on 1% of large problems and recomputed it, wrongly.)"""
    think = example.answer if after_call else f"{expression(example)} = {example.answer}"
    return f"<think>\n{think}\n</think>\n<answer>\n{example.answer}\n</answer>"


def call_message(example: Example) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function",
                            "function": {"name": "calculator", "arguments": {"expression": expression(example)}}}]}


def render_ids(tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_ids(tokenizer, prompt_messages: list[dict], message: dict, tools: list[dict]) -> list[int]:
    """The ids of one assistant turn as the model samples it (text after the generation prompt, then EOS):
    the template's rendering of ``message`` with the prompt cut off, tokenized on its own as the trainer
    tokenizes completions."""
    prompt = tokenizer.apply_chat_template(prompt_messages, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(prompt_messages + [message], tools=tools, tokenize=False)
    assert full.startswith(prompt) and full.endswith(tokenizer.eos_token + "\n"), (prompt, full)
    body = full[len(prompt):-len(tokenizer.eos_token + "\n")]
    return tokenizer(body, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def example_row(tokenizer, example: Example, use_tool: bool, system_prompt: str, tools: list[dict]):
    """(ids, labels) of one problem: labels on the sampled turns only (-100 on prompt and tool result)."""
    messages = build_prompt_messages(example, system_prompt)
    prompt = render_ids(tokenizer, messages, tools)
    if not use_tool:
        answer = turn_ids(tokenizer, messages, {"role": "assistant", "content": answer_text(example)}, tools)
        return prompt + answer, [-100] * len(prompt) + answer
    call = call_message(example)
    call_ids = turn_ids(tokenizer, messages, call, tools)
    result = {"role": "tool", "name": "calculator", "content": calculator(expression(example))}
    suffix = tool_suffix_ids(tokenizer, [result], [tokenizer.eos_token_id])
    answer = turn_ids(tokenizer, messages + [call, result],
                      {"role": "assistant", "content": answer_text(example, after_call=True)}, tools)
    ids = prompt + call_ids + suffix + answer
    labels = [-100] * len(prompt) + call_ids + [-100] * len(suffix) + answer
    return ids, labels


def training_problem_seed(seed: int, step: int) -> int:
    """Generator seed of one step's problems: 10**6 and up, never the held-out seed."""
    return 1_000_000 + seed * 100_000 + step


def problem_rows(tokenizer, step: int, rng: random.Random, settings) -> tuple[list, dict]:
    """One step's rows (half large, half small problems) and counts of what they teach."""
    tools = [tool_schema(calculator)]
    examples = generate_tool_problems(settings.batch_size, seed=training_problem_seed(settings.seed, step),
                                      size="mix")
    rows, counts = [], {"large": 0, "large_tool": 0, "small": 0, "small_tool": 0}
    for example in examples:
        size = "large" if is_large(example) else "small"
        fraction = settings.tool_fraction_large if size == "large" else settings.tool_fraction_small
        use_tool = rng.random() < fraction
        counts[size] += 1
        counts[f"{size}_tool"] += use_tool
        rows.append(example_row(tokenizer, example, use_tool, settings.system_prompt, tools))
    return rows, counts


def shared_prompt_prefix(tokenizer, system_prompt: str) -> list[int]:
    """Ids every training prompt starts with: the system turn with the tools header, the user turn's opening."""
    probe = Example(messages=[{"role": "user", "content": "\x00"}], answer=None, answer_raw=None, source="probe")
    text = tokenizer.apply_chat_template(build_prompt_messages(probe, system_prompt), tools=[tool_schema(calculator)],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text[:text.index("\x00")], add_special_tokens=False)["input_ids"]


def describe(tokenizer, ids: list[int]) -> str:
    return json.dumps(tokenizer.decode(ids))
