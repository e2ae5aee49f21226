"""The OpenAI chat route as agents use it, with the official `openai` client against a real
`rl inference` (vLLM) serving the tiny tool model: `tools=` answered with parsed tool calls
(inference.tool_call_parser, hermes), the sampled token ids returned (`return_token_ids`) equal
to the engine's own on /generate, and every answer tagged with the policy version(s) that
sampled it."""

from __future__ import annotations

import asyncio
import json
import subprocess

import aiohttp
import httpx
import openai
import pytest

from conftest import ROOT, free_port, rl_command
from orchestrator.rollout.tool_functions import Tool
from programs import launch_server, wait_healthy
from rl.inference_api import connector
from rl.rundir import RunDir
from server_calls import post, wait_running
from tasks.calculator import Calculator, rows


pytestmark = pytest.mark.slow

TOOL_MODEL = ROOT / "models" / "tiny-tool"
TOOLS = [Tool.from_function(f).schema for f in Calculator.tools]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat_tools")
    proc, url = launch_server(tmp, "server", TOOL_MODEL, RunDir(tmp / "run").root, seq_len=256)
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        proc.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def questions(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": r["prompt"]}] for r in rows(10_000, n)]


def test_tools_come_back_as_parsed_tool_calls(server):
    """Greedy, the tool model calls `calculate` on most held-out questions (0.84 exact calls when
    built): each answer whose text held a <tool_call> comes back as message.tool_calls, with JSON
    arguments, finish_reason "tool_calls" and no call text left in the content."""
    called = 0
    for messages in questions(8):
        answer = client(server).chat.completions.create(model=str(TOOL_MODEL), messages=messages, tools=TOOLS,
                                                       temperature=0, max_tokens=64)
        choice = answer.choices[0]
        if choice.message.tool_calls:
            called += 1
            call = choice.message.tool_calls[0]
            assert call.type == "function" and call.function.name == "calculate", call
            assert isinstance(json.loads(call.function.arguments)["expression"], str)
            assert choice.finish_reason == "tool_calls"
            assert "<tool_call>" not in (choice.message.content or "")
    assert called >= 4, f"the tool model called calculate on {called} of 8 questions"
    # The calls go on as a conversation: the tool's result in a tool message, the final answer.
    # Greedy decoding makes the first turn the same every run: the first held-out question is
    # one the model answers with a call, so the follow-up always runs.
    messages = questions(1)[0]
    first = client(server).chat.completions.create(model=str(TOOL_MODEL), messages=messages, tools=TOOLS,
                                                  temperature=0, max_tokens=64).choices[0].message
    assert first.tool_calls, f"greedy, the tool model answered the first question without a call: {first}"
    call = first.tool_calls[0]
    result = Calculator.tools[0](**json.loads(call.function.arguments))
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client(server).chat.completions.create(model=str(TOOL_MODEL), messages=messages, tools=TOOLS,
                                                  temperature=0, max_tokens=16).choices[0]
    assert final.finish_reason == "stop" and final.message.content, final


def test_token_ids_are_the_engines_and_answers_carry_their_version(server):
    """return_token_ids: the prompt and completion ids of the chat answer; the same prompt ids on
    /generate (token in, token out) give the same greedy tokens. The version headers say which
    weights sampled them (0: the model the server started on)."""
    raw = client(server).chat.completions.with_raw_response.create(
        model=str(TOOL_MODEL), messages=questions(1)[0], tools=TOOLS, temperature=0, max_tokens=64,
        extra_body={"return_token_ids": True})
    assert raw.headers["x-asyncrl-version-start"] == "0" and raw.headers["x-asyncrl-version"] == "0"
    answer = raw.parse()
    choice = answer.choices[0]
    prompt_ids, completion_ids = answer.prompt_token_ids, choice.token_ids
    assert prompt_ids and completion_ids, answer
    engine = httpx.post(f"{server}/generate", json={"prompt_token_ids": prompt_ids, "max_tokens": 64,
                                                    "temperature": 0, "request_id": "same-prompt"},
                        timeout=120).json()["samples"][0]
    assert engine["token_ids"] == completion_ids
    assert set(engine["versions"]) == {0}


def test_a_parser_vllm_does_not_have_is_refused_at_start_up(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'model = "{TOOL_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nseq_len = 256\n'
                   f'[inference]\nport = {free_port()}\ntool_call_parser = "no_such_parser"\n')
    result = subprocess.run(rl_command("inference", "@", str(cfg)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "inference.tool_call_parser 'no_such_parser': vLLM has no such tool-call parser" in lines[0]


def test_the_two_version_headers_differ_when_an_update_lands_mid_answer(server):
    """docs/tools.md: different headers mean an update landed while the answer generated. A chat
    answer of N long choices (ignore_eos) is caught running on vLLM's gauge (it has arrived:
    its start header is the old version), then an update in "keep" mode (the served weights
    again under a new version: only the label moves) freezes it between two decode steps and
    resumes it on the new one. If the update answered while the answer was still out, the
    answer ended under the new version. An answer that finished first (a starved gauge poll)
    is asked again, under the next version."""
    n = 4

    async def main():
        async with aiohttp.ClientSession(connector=connector()) as s:
            for version in range(1, 4):
                answer = asyncio.create_task(asyncio.to_thread(
                    client(server).chat.completions.with_raw_response.create,
                    model=str(TOOL_MODEL), messages=questions(1)[0], n=n, temperature=1,
                    max_tokens=96, extra_body={"ignore_eos": True}))
                caught = await wait_running(s, server, lambda c: c == n, timeout=120, task=answer)
                status, update = await post(s, f"{server}/update_weights",
                                            {"path": str(TOOL_MODEL), "version": version, "mode": "keep"})
                assert status == 200 and update["version"] == version, update
                out_still = not answer.done()
                raw = await answer
                if caught is not None and out_still:
                    return version, raw
            raise AssertionError("3 answers finished before an update caught them running")

    version, raw = asyncio.run(main())
    assert raw.headers["x-asyncrl-version-start"] == str(version - 1)
    assert raw.headers["x-asyncrl-version"] == str(version)
    assert [c.finish_reason for c in raw.parse().choices] == ["length"] * n
