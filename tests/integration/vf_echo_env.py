"""A verifiers taskset for the tests (test_verifiers_train.py): say a number; rewards ``has_digit`` (weight 2) and
``short`` (weight 0.5). Played by ``ChatHarness``, the plain single-agent loop run in-process (verifiers' own
harnesses run programs through ``uv`` with packages from the network, which the tests have not; a harness may
run its loop in-process when every model call goes through the interception endpoint: ``vf.Harness.launch``)."""

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult


def reply_text(trace) -> str:
    messages = trace.branches[-1].messages if trace.branches else []
    return "".join(str(m.content or "") for m in messages if m.role == "assistant")


class EchoTask(vf.Task):
    @vf.reward(weight=2.0)
    async def has_digit(self, task, trace) -> float:
        return float(any(c.isdigit() for c in reply_text(trace)))

    @vf.reward(weight=0.5)
    async def short(self, task, trace) -> float:
        return float(len(reply_text(trace)) < 8)


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for i in range(6):
            yield EchoTask(vf.TaskData(prompt=f"Say the number {i}."))


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """The plain single-agent loop, in-process: one chat-completions call through the interception endpoint."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        await AsyncOpenAI(base_url=endpoint, api_key=secret).chat.completions.create(model=ctx.model,
                                                                                      messages=messages)
        return ProgramResult(0, "", "")


__all__ = ["ChatHarness", "EchoTaskset"]
