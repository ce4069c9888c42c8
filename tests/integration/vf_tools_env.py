"""A multi-turn taskset: the harness runs a tool (``count_digits``) on each reply and sends its result back as
the next user turn, ``TURNS`` model turns in all; reward ``digits_seen`` (weight 1): the tool found a digit."""

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

TURNS = 2


def count_digits(text: str) -> int:
    return sum(c.isdigit() for c in text)


class CountTask(vf.Task):
    @vf.reward
    async def digits_seen(self, task, trace) -> float:
        messages = trace.branches[-1].messages if trace.branches else []
        return float(any(count_digits(str(m.content or "")) for m in messages if m.role == "assistant"))


class CountTaskset(vf.Taskset[CountTask, vf.TasksetConfig]):
    def load(self):
        for i in range(6):
            yield CountTask(vf.TaskData(prompt=f"Write {i} digits."))


class ToolHarness(vf.Harness[vf.HarnessConfig]):
    """A tool loop, in-process: reply, the tool's result as the next user message, reply again."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret)
        _, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}]
        for _ in range(TURNS):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            text = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"count_digits -> {count_digits(text)}"}]
        return ProgramResult(0, "", "")


__all__ = ["CountTaskset", "ToolHarness"]
