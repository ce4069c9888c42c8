"""Datasets: from files, the hub or the synthetic generator to `Example` records, and on to prompt text.

Data flow: a source string (`load_dataset_source`) or a direct loader (`load_gsm8k`,
`load_prompts`, `generate_problems`) gives a list of `Example` (chat history without system
prompt, gold answer, location); `build_prompt_messages` adds the run's system prompt and
`render_prompt` applies the tokenizer's chat template. `Example.columns()` is what reward
functions receive as keyword arguments. Every malformed input raises `DataError` naming the file
and 1-based line.

Modules: example (Example, DataError), readers (jsonl/json/parquet rows), locations (file /
folder / hub id), gold_formats (gold answer formats), gsm8k, prompt_datasets (other prompt files,
src/tgt), prompts (system prompt + chat template), tags (the answer tag styles), synthetic (+
synthetic_templates), sources (spec strings), prompt_sampler (which prompts each step and rank
gets), sft (prompt/response pairs for the PTX loss) and sft_tokens (their tokenisation).
"""

from grpo.data.example import DataError, Example, PromptTooLong
from grpo.data.gold_formats import ANSWER_FORMATS, GoldAnswer, get_answer_format, is_number, normalise_answer
from grpo.data.gsm8k import (
    GSM8K_HUB_CONFIG,
    GSM8K_HUB_ID,
    gsm8k_example,
    load_gsm8k,
    to_gsm8k_record,
    write_gsm8k_jsonl,
)
from grpo.data.prompt_datasets import load_prompts
from grpo.data.prompts import (
    build_prompt_messages,
    default_system_prompt,
    render_example,
    render_prompt,
    resolve_system_prompt,
)
from grpo.data.sft import RESPONSE_FORMATS, SftPair, load_sft_pairs
from grpo.data.sources import SOURCE_KINDS, load_dataset_source
from grpo.data.synthetic import DIFFICULTIES, MIXED, Difficulty, Step, generate_problems, solution_chain

__all__ = [
    "ANSWER_FORMATS",
    "DIFFICULTIES",
    "GSM8K_HUB_CONFIG",
    "GSM8K_HUB_ID",
    "MIXED",
    "RESPONSE_FORMATS",
    "SOURCE_KINDS",
    "SftPair",
    "DataError",
    "PromptTooLong",
    "Difficulty",
    "Example",
    "GoldAnswer",
    "Step",
    "build_prompt_messages",
    "default_system_prompt",
    "generate_problems",
    "get_answer_format",
    "gsm8k_example",
    "is_number",
    "load_dataset_source",
    "load_gsm8k",
    "load_prompts",
    "load_sft_pairs",
    "normalise_answer",
    "render_example",
    "render_prompt",
    "resolve_system_prompt",
    "solution_chain",
    "to_gsm8k_record",
    "write_gsm8k_jsonl",
]
