"""A verifiers taskset whose harness fails on purpose (test_verifiers_train.py): on task 0 it raises, on task 1
it hangs past any episode timeout, on the others it makes one chat call like ``vf_echo_env.ChatHarness``.
Reward ``replied`` (weight 1): the episode got a reply."""

import asyncio

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

RAISES, HANGS = "task 0", "task 1"


class ReplyTask(vf.Task):
    @vf.reward
    async def replied(self, task, trace) -> float:
        messages = trace.branches[-1].messages if trace.branches else []
        return float(any(m.role == "assistant" for m in messages))


class FailingTaskset(vf.Taskset[ReplyTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield ReplyTask(vf.TaskData(prompt=f"task {i}"))


class FailingHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        if data.prompt == RAISES:
            raise RuntimeError("the agent program crashed")
        if data.prompt == HANGS:
            await asyncio.sleep(3600)
        await AsyncOpenAI(base_url=endpoint, api_key=secret).chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": data.prompt}])
        return ProgramResult(0, "", "")


__all__ = ["FailingHarness", "FailingTaskset"]
