"""A tiny verifiers v1 taskset for tests/orchestrator/test_verifiers_taskset.py, loaded by id as verifiers
loads any installed taskset: id "vf-tiny-taskset" imports this module (tests/ is on sys.path) and
takes the Taskset its __all__ exports.

Tasks: "What is i + (i+1)?" with a calculator toolset (calc_add, sync; calc_mul, async); the
reward is 1 when the last reply is the answer. `differing_tools = true` gives odd tasks a config
whose toolset adds calc_sub (tools asyncrl must refuse: they differ between tasks); `unsupported`
names a feature asyncrl refuses (see UNSUPPORTED)."""

from __future__ import annotations

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"  # the model sees "calc_add"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool(name="mul")
    async def multiply(self, a: int, b: int = 1) -> int:
        """Multiply two integers."""
        return a * b


class SubToolset(CalcToolset):
    @vf.tool
    def sub(self, a: int, b: int) -> int:
        """Subtract b from a."""
        return a - b


class CounterState(vf.State):
    calls: int = 0


class CountingToolset(vf.Toolset[vf.ToolsetConfig, CounterState]):
    @vf.tool
    def count(self) -> int:
        """Count calls."""
        self.state.calls += 1
        return self.state.calls


class TinyData(vf.TaskData):
    answer: str


class TinyTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    subtract: bool = False
    counting: bool = False


class TinyTask(vf.Task[TinyData, vf.State, TinyTaskConfig]):
    @classmethod
    def toolsets(cls, config: TinyTaskConfig) -> list[vf.Toolset]:
        return [(SubToolset if config.subtract else CalcToolset)(config.tools),
                *([CountingToolset(vf.ToolsetConfig())] if config.counting else [])]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class RuntimeRewardTask(TinyTask):
    @vf.reward
    async def in_box(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class StoppingTask(TinyTask):
    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return len(trace.nodes) > 4


class SetupTask(TinyTask):
    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        return None


UNSUPPORTED = {"runtime_reward": RuntimeRewardTask, "stop": StoppingTask, "setup": SetupTask}


class TinyConfig(vf.TasksetConfig):
    num_tasks: int = 3
    differing_tools: bool = False
    unsupported: str = ""
    """One of UNSUPPORTED's keys (a task class), "state" (a toolset with tool-side State) or
    "remote" (a toolset served at a URL)."""
    task: TinyTaskConfig = TinyTaskConfig()


class TinyTaskset(vf.Taskset[TinyTask, TinyConfig]):
    def load(self):
        odd = self.config.task.model_copy(update={"subtract": True})
        task_class = UNSUPPORTED.get(self.config.unsupported, TinyTask)
        update = {"state": {"counting": True},
                  "remote": {"tools": vf.ToolsetConfig(url="http://127.0.0.1:9/mcp")}}.get(self.config.unsupported, {})
        for i in range(self.config.num_tasks):
            config = odd if self.config.differing_tools and i % 2 else self.config.task.model_copy(update=update)
            yield task_class(
                TinyData(
                    prompt=[vf.UserMessage(content=f"What is {i} + {i + 1}? Use the tool.")],
                    system_prompt="Answer with a number only.",
                    answer=str(2 * i + 1),
                ),
                config,
            )


__all__ = ["TinyTaskset"]
