"""The external-agent environment kind (orchestrator/rollout/agent_environment.py, agent_endpoint.py): an
agent written only against the official `openai` client trains the model inside its own loop.

- How an episode's requests become samples (one growing conversation is one sample; edited
  history starts another).
- The endpoint, driven by the official client, answers as OpenAI does; its generate is scripted
  here (a fake for control: which ids the "model" writes), the real server's is the run below.
- A real `rl run` (vLLM, the trainer) of the calculator task played by such an agent."""

from __future__ import annotations

import asyncio
import json
import subprocess

import numpy as np
import openai
import pytest

from conftest import ROOT, free_port, rl_command
from orchestrator.rollout.agent_environment import rebuilt
from orchestrator.rollout.groups import Rollouts
from tasks.calculator_agent import TOOLS, CalculatorAgent
from orchestrator.rendering.tokenizer import load_tokenizer
from rl.batch import Batch
from rl.config import load_config
from rl.inference_api import GeneratedSample, GenerateResponse
from rl.rundir import RunDir

TOOL_MODEL = ROOT / "models" / "tiny-tool"


def sampled(ids: list[int], version: int = 0, finish: str = "stop") -> GeneratedSample:
    return GeneratedSample(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[version] * len(ids),
                           finish_reason=finish)


def test_a_growing_conversation_is_one_sample_and_edited_history_starts_another():
    turns = [([1, 2, 3], sampled([10, 11], version=0), []),
             ([1, 2, 3, 10, 11, 20, 21], sampled([12], version=1), []),   # grew: one sample
             ([1, 2, 3, 99], sampled([13, 14], version=1), [])]            # history edited: a new one
    t = rebuilt(turns, reward=0.75)
    assert t.tokens == [1, 2, 3, 10, 11, 20, 21, 12]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert t.versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5]
    [second] = t.parts
    assert (second.tokens, second.loss_mask, second.reward) == ([1, 2, 3, 99, 13, 14], [0, 0, 0, 0, 1, 1], 0.75)
    assert t.episode == {"turns": 3, "samples": 2, "tokens": 14}


def endpoint_and_tokenizer(max_tokens: int = 64, seq_len: int = 256):
    cfg, _ = load_config(["@", str(ROOT / "configs" / "tools_demo.toml"), "--orchestrator.environment.class",
                          "tasks.calculator_agent:CalculatorAgent", "--orchestrator.sampling.max_tokens",
                          str(max_tokens), "--seq_len", str(seq_len)])
    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, CalculatorAgent())
    return rollouts.kind, rollouts


def test_the_endpoint_answers_the_official_client_as_openai_does():
    kind, toolkit = endpoint_and_tokenizer()
    endpoint = kind.endpoint
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    written = toolkit.encode(call, add_special_tokens=False) + kind.stop_token_ids[:1]
    asked = []

    async def generate(request):
        asked.append(request)
        return GenerateResponse(samples=[sampled(written)])

    async def main():
        await endpoint.start()
        key, record = endpoint.open("g-e0", generate)
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": "Calculate 2+3."}]
        answer = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=20,
                                                      temperature=0.0)
        refusals = []
        for kwargs in ({"stream": True}, {"n": 2}):
            try:
                await client.chat.completions.create(model="m", messages=messages, **kwargs)
            except openai.BadRequestError as e:
                refusals.append(e.message)
        try:
            await openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="episode-unknown", max_retries=0
                                     ).chat.completions.create(model="m", messages=messages)
        except openai.AuthenticationError as e:
            refusals.append(e.message)
        endpoint.close(key)
        await endpoint.stop()
        return answer, record, refusals

    answer, record, refusals = asyncio.run(main())
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "calculate" and json.loads(tool_call.function.arguments) == {"expression": "2+3"}
    # Rendered by the template with the tools; the run's sampling, the agent's max_tokens honoured.
    [request] = asked
    text = toolkit.renderer.template.render([{"role": "user", "content": "Calculate 2+3."}], True, TOOLS)
    assert request.prompt_token_ids == toolkit.encode(text, add_special_tokens=False)
    assert request.max_tokens == 20 and request.temperature == 1.0  # tools_demo's temperature, not the agent's 0
    assert record.turns == [(request.prompt_token_ids, sampled(written), [])]
    assert ["stream" in refusals[0], "n: one completion" in refusals[1], "unknown API key" in refusals[2]] == [True] * 3


def test_a_request_without_room_is_answered_empty_and_cut():
    kind, _ = endpoint_and_tokenizer(max_tokens=16, seq_len=64)

    async def generate(request):
        raise AssertionError("nothing should be sampled")

    async def main():
        await kind.endpoint.start()
        key, record = kind.endpoint.open("g-e1", generate)
        client = openai.AsyncOpenAI(base_url=kind.endpoint.base_url, api_key=key, max_retries=0)
        answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x " * 80}])
        await kind.endpoint.stop()
        return answer, record

    answer, record = asyncio.run(main())
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content == ""
    assert record.out_of_room and record.turns == []


@pytest.mark.slow
def test_an_agent_written_against_the_openai_client_trains_in_a_real_run(tmp_path):
    """rl run (real vLLM and trainer) of the calculator task played by CalculatorAgent: every
    step trains; its multi-turn episodes reach the batches as one sample each, the model's two
    turns trained (mask 1) and the tool's answer between them context (mask 0)."""
    steps = 3
    out = tmp_path / "run"
    result = subprocess.run(rl_command("run", "@", str(ROOT / "configs" / "tools_demo.toml"),
                                       "--orchestrator.environment.class", "tasks.calculator_agent:CalculatorAgent",
                                       "--max_steps", str(steps),
                                       "--output_dir", str(out), "--inference.port", str(free_port()),
                                       "--trainer.files.keep_rollouts", str(steps)),
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if r["program"] == "trainer") == list(range(1, steps + 1))
    orchestrator = [r for r in records if r["program"] == "orchestrator"]
    assert all(r["episode/turns"] > 1 for r in orchestrator), orchestrator  # the agent called the tool
    spans = []
    for step in range(1, steps + 1):
        batch = Batch.read(RunDir(out).rollout_dir(step))
        for piece in batch.sample_slices():
            mask = np.asarray(batch.loss_mask[piece])
            spans.append(int(np.count_nonzero(np.diff(mask) == 1)) + int(mask[0] == 1))
    assert max(spans) >= 2, spans  # a sample holding two model turns: the conversation was rebuilt as one
