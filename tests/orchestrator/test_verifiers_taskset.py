"""A verifiers v1 taskset (tests/vf_tiny_taskset.py, loaded by id like any installed one) as an
asyncrl tool environment (orchestrator/rollout/verifiers_taskset.py): its rows, messages and tool
schemas, episodes through asyncrl's own rollout code with a scripted model, rewards from the
taskset's own @vf.reward through task.score, and the config path. No hub, no network."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys

import pytest

pytest.importorskip("verifiers.v1", reason="the verifiers extra (pip install asyncrl[verifiers])")

from orchestrator.prompts.queue import Prompt  # noqa: E402
from orchestrator.rollout.groups import Rollouts  # noqa: E402
from orchestrator.rendering.tokenizer import load_tokenizer  # noqa: E402
from orchestrator.rollout.verifiers_taskset import VerifiersTaskset  # noqa: E402
from rl.config import ConfigError  # noqa: E402
from orchestrator.preflight import orchestrator_code  # noqa: E402
from orchestrator.rollout.tool_functions import load_tools  # noqa: E402
from scripted_model import TOKENIZER, ScriptedModel, config  # noqa: E402

ENV = "orchestrator.rollout.verifiers_taskset:VerifiersTaskset"
TINY = "vf-tiny-taskset"
CALC_ADD = {"type": "function", "function": {
    "name": "calc_add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def env() -> VerifiersTaskset:
    return VerifiersTaskset(TINY, num_tasks=5)


def call(name: str, arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def run(environment_args: dict, row: dict, script: list[str]):
    """One group of two episodes of the configured taskset, through the orchestrator's rollouts."""
    cfg = config(ENV, args={"id": TINY, **environment_args})
    env = VerifiersTaskset(**cfg.orchestrator.environment.args)
    model = ScriptedModel(script)
    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, env)
    return model, asyncio.run(rollouts.group(Prompt(0, row), "g0", model))


def seen_by_model(model: ScriptedModel, turn: int) -> str:
    """What episode 0's request for `turn` showed the model."""
    prompt = next(p for rid, p, _ in model.calls if rid == f"g0-e0-t{turn}")
    return TOKENIZER.decode(prompt, skip_special_tokens=False)


# --- (1) rows, messages, tools -------------------------------------------------------------


def test_rows_are_task_indices_every_pass_a_fresh_shuffle(env):
    rows = list(itertools.islice(env.dataset(7), 15))
    assert all(json.loads(json.dumps(r)) == r and set(r) == {"task"} for r in rows)
    passes = [[r["task"] for r in rows[i:i + 5]] for i in (0, 5, 10)]
    assert all(sorted(p) == list(range(5)) for p in passes)  # each pass: every task once
    assert len({tuple(p) for p in passes}) > 1                # reshuffled between passes
    assert rows == list(itertools.islice(env.dataset(7), 15))  # same seed, same rows
    assert rows != list(itertools.islice(env.dataset(8), 15))


def test_messages_are_the_tasks_system_prompt_and_prompt(env):
    for i in range(5):
        assert env.messages({"task": i}) == [
            {"role": "system", "content": "Answer with a number only."},
            {"role": "user", "content": f"What is {i} + {i + 1}? Use the tool."}]


def test_tools_are_the_toolsets_methods_as_verifiers_names_and_describes_them(env):
    assert VerifiersTaskset.tools == [] and env.tools  # a tool environment to rl/preflight.py
    tools = load_tools(env.tools, "test")
    assert list(tools) == ["calc_add", "calc_mul"]
    assert tools["calc_add"].schema == CALC_ADD
    assert tools["calc_mul"].schema["function"]["parameters"]["required"] == ["a"]  # b has a default
    assert not asyncio.iscoroutinefunction(env.tools[0]) and asyncio.iscoroutinefunction(env.tools[1])

    # verifiers' own MCP server advertises the same names, descriptions and parameters (less
    # pydantic's titles and defaults).
    from mcp.server.mcpserver import MCPServer
    import verifiers.v1 as vf
    import vf_tiny_taskset

    toolset = vf_tiny_taskset.CalcToolset(vf.ToolsetConfig())
    server = MCPServer(toolset.server_name)
    toolset.register(server)

    def strip(schema):
        if isinstance(schema, dict):
            return {k: strip(v) for k, v in schema.items() if k not in ("title", "default")}
        return schema

    theirs = {f"{toolset.server_name}_{t.name}": (t.description, strip(t.input_schema))
              for t in asyncio.run(server.list_tools())}
    ours = {n: (t.schema["function"]["description"], t.schema["function"]["parameters"]) for n, t in tools.items()}
    assert ours == theirs
    # The result text is what verifiers' MCP server sends back.
    assert asyncio.run(server.call_tool("mul", {"a": 6, "b": 7})).content[0].text == asyncio.run(
        tools["calc_mul"].call({"a": 6, "b": 7}, 1.0)) == "42"


def test_the_reward_scores_a_trace_built_from_the_conversation(env):
    row = {"task": 2}
    conversation = env.messages(row) + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0_0", "type": "function", "function": {"name": "calc_add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "name": "calc_add", "content": "5"},
        {"role": "assistant", "content": "5"}]
    trace = env.trace(env.task(row), conversation, opening=2)
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trace.assistant_messages[0].tool_calls[0].name == "calc_add"
    assert json.loads(trace.assistant_messages[0].tool_calls[0].arguments) == {"a": 2, "b": 3}
    assert trace.last_reply == "5" and [t.name for t in trace.tools] == ["calc_add", "calc_mul"]
    asyncio.run(env.task(row).score(trace))
    assert trace.rewards["correct"].score == 1.0 and trace.metrics == {"tool_calls": 1.0}
    assert asyncio.run(env.reward(conversation, row)) == 1.0
    assert asyncio.run(env.reward(conversation[:-1] + [{"role": "assistant", "content": "6"}], row)) == 0.0


# --- (2), (3) episodes through asyncrl's rollouts ------------------------------------------


def test_an_episode_calls_the_tool_and_is_rewarded_by_the_tasks_reward():
    model, group = run({"num_tasks": 3}, {"task": 1}, [call("calc_add", {"a": 1, "b": 2}), "3"])
    assert group.failed == 0 and group.rewards == [1.0, 1.0]
    assert [(e["turns"], e["tool_calls"], e["tool_errors"]) for e in group.episodes] == [(2, 1, 0)] * 2
    first, second = seen_by_model(model, 0), seen_by_model(model, 1)
    assert '"name": "calc_add"' in first and "What is 1 + 2? Use the tool." in first
    assert second.endswith("<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")

    _, wrong = run({"num_tasks": 3}, {"task": 1}, [call("calc_add", {"a": 1, "b": 2}), "4"])
    assert wrong.failed == 0 and wrong.rewards == [0.0, 0.0]
    # The reward is the taskset's, weighted as its config says (task.score's weighted sum).
    _, half = run({"num_tasks": 3, "task": {"rewards": {"correct": {"weight": 0.5}}}}, {"task": 1},
                  [call("calc_add", {"a": 1, "b": 2}), "3"])
    assert half.rewards == [0.5, 0.5]


def test_tool_errors_reach_the_model_and_are_counted():
    script = [call("calc_add", {"a": "x", "b": 1}) + "\n" + call("calc_mul", {"a": 2, "b": 3}) + "\n"
              + call("calc_div", {"a": 1}), "1"]
    model, group = run({"num_tasks": 3}, {"task": 0}, script)
    assert group.failed == 0 and group.rewards == [1.0, 1.0]
    assert [(e["tool_calls"], e["tool_errors"]) for e in group.episodes] == [(3, 2)] * 2
    seen = seen_by_model(model, 1)
    replies = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", seen, re.S)
    assert replies == ['error: calc_add: argument a: "x" is not an integer', "6",
                       "error: unknown tool 'calc_div'; the tools are calc_add, calc_mul"]


# --- (4) the config path -------------------------------------------------------------------


def test_the_config_names_a_taskset_by_id():
    cfg = config(ENV, args={"id": TINY, "num_tasks": 2})
    orchestrator_code(cfg)
    rollouts = Rollouts.from_config(cfg, None)
    assert list(rollouts.kind.tool_episode.tools) == ["calc_add", "calc_mul"]
    assert len(rollouts.kind.env.tasks) == 2

    with pytest.raises(ConfigError, match="takes|signature"):
        orchestrator_code(config(ENV, args={"num_tasks": 2}))  # no id


@pytest.mark.parametrize("args, message", [
    ({"id": "vf-no-such-taskset"}, "verifiers taskset 'vf-no-such-taskset' not found: no module 'vf_no_such_taskset'"),
    ({"id": TINY, "num_taskz": 2}, f"verifiers taskset '{TINY}': environment.args {{'num_taskz': 2}} do not fit "
                                   "its config TinyConfig: num_taskz: Extra inputs are not permitted"),
    ({"id": TINY, "differing_tools": True}, f"verifiers taskset '{TINY}': task 1 offers other tools than task 0 "
                                            "(calc_add, calc_mul, calc_sub vs calc_add, calc_mul)"),
    ({"id": TINY, "unsupported": "runtime_reward"},
     f"verifiers taskset '{TINY}': task RuntimeRewardTask's in_box needs a runtime (a sandbox)"),
    ({"id": TINY, "unsupported": "stop"},
     f"verifiers taskset '{TINY}': task StoppingTask has stop predicates (enough)"),
    ({"id": TINY, "unsupported": "setup"}, f"verifiers taskset '{TINY}': task SetupTask defines setup()"),
    ({"id": TINY, "unsupported": "state"},
     f"verifiers taskset '{TINY}': toolset CountingToolset keeps tool-side state (CounterState)"),
    ({"id": TINY, "unsupported": "remote"},
     f"verifiers taskset '{TINY}': toolset CalcToolset is a remote MCP server (http://127.0.0.1:9/mcp)"),
])
def test_a_bad_taskset_is_one_line_naming_it(args, message):
    cfg = config(ENV, args=args)
    for start in (orchestrator_code, lambda cfg: Rollouts.from_config(cfg, None)):  # --dry-run, then the program
        with pytest.raises(ConfigError) as e:
            start(cfg)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_without_verifiers_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=re.escape("pip install asyncrl[verifiers]")):
        VerifiersTaskset(TINY)
