"""Episodes with pictures on one real `rl inference` (vLLM CPU, models/tiny-vlm), for the
orchestrator's picture tests (test_agent_images.py, test_turn_images.py): the first of them to
need it starts the server (a free port), plays every kind's episodes on it (an agent's, the
built-in tool loop's, a text environment's) and stops it, so that the trainer runs after it
have the cores; the other module of the same process reads the same results (under xdist, a
worker that runs only one of them starts its own). Also what both modules use without an
engine: the models, a scripted engine (Scripted), each kind's Rollouts, the float64 check."""

from __future__ import annotations

import asyncio
import io

import numpy as np
from PIL import Image

from conftest import ROOT
from orchestrator.prompts.queue import Prompt
from orchestrator.rendering import image_support
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rollout.groups import Rollouts
from orchestrator.rollout.tool_parsers import ToolCall
from rl.config import RunConfig, load_config
from rl.inference_api import GeneratedSample, GenerateResponse
from tasks.shapes_agent import ShapesAgent
from tasks.shapes_tools import ShapesTools, ShapesTurns

VLM = ROOT / "models" / "tiny-vlm"
TEXT_MODEL = ROOT / "models" / "tiny-tool"
SEQ_LEN = 256


def sampled(ids: list[int], version: int = 0, finish: str = "stop") -> GeneratedSample:
    return GeneratedSample(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[version] * len(ids),
                           finish_reason=finish)


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def agent_rollouts(env, model=VLM, group_size: int = 2, max_tokens: int = 12) -> Rollouts:
    cfg, _ = load_config(["--model", str(model), "--seq_len", str(SEQ_LEN),
                          "--orchestrator.environment.class", "tasks.shapes_agent:ShapesAgent",
                          "--orchestrator.sampling.max_tokens", str(max_tokens),
                          "--orchestrator.scheduling.group_size", str(group_size)])
    return Rollouts(cfg, load_tokenizer(cfg.model), {}, None, env)


class Scripted:
    """The endpoint's generate, scripted: each request answered with `written`, the engine's
    expanded prompt being the orchestrator's (or `expanded`, when given)."""

    def __init__(self, written: list[int], expanded=None):
        self.written, self.expanded, self.asked = written, expanded, []

    async def __call__(self, request):
        self.asked.append(request)
        support, tok = image_support(VLM), load_tokenizer(str(VLM))
        image = tok.token_to_id(support.image_token)
        expansion = tok.encode(support.expansion(), add_special_tokens=False).ids
        ids = [x for t in request.prompt_token_ids for x in (expansion if t == image else [t])]
        return GenerateResponse(samples=[sampled(self.written)], prompt_token_ids=self.expanded or ids)


class AlwaysLooks:
    """A tool parser that reads every answer as a call to look at a new board ("call0", "call1",
    ...): the random tiny-vlm never writes a call itself, and the loop under test is what
    follows one."""

    calls = 0

    def parse(self, text: str):
        AlwaysLooks.calls += 1
        return text, [ToolCall("look", {"board": f"call{AlwaysLooks.calls}"})]


class Recorded(ShapesTools):
    """ShapesTools keeping each episode's conversation (as its reward reads it)."""

    def __init__(self, tools=None):
        self.conversations: list[list[dict]] = []
        if tools is not None:
            self.tools = tools

    def reward(self, messages: list[dict], row: dict) -> float:
        self.conversations.append(messages)
        return super().reward(messages, row)


def turn_rollouts(env, cls: str, model=VLM, max_turns: int = 3, group_size: int = 2, **sampling) -> Rollouts:
    cfg = RunConfig.model_validate({"model": str(model), "seq_len": SEQ_LEN, "orchestrator": {
        "environment": {"class": cls, "max_turns": max_turns},
        "tools": {"parser": "picture_episodes:AlwaysLooks"},
        "sampling": {"max_tokens": 8, **sampling}, "scheduling": {"group_size": group_size}}})
    return Rollouts(cfg, load_tokenizer(cfg.model), {}, None, env)


# --- on the real engine ------------------------------------------------------------------------


class Transcripts(ShapesAgent):
    """tasks/shapes_agent.py's agent, keeping each episode's conversation as it sent it."""

    def __init__(self):
        self.kept: list[list[dict]] = []

    async def conversation(self, row: dict, access) -> list[dict]:
        messages = await super().conversation(row, access)
        self.kept.append(messages)
        return messages


async def play_agents(generate) -> dict:
    """Two groups of two episodes of Transcripts through `generate` (the real engine's:
    tests/picture_episodes.py, whose server the turn-picture tests share)."""
    env = Transcripts()
    r = agent_rollouts(env)
    rows = [row for row, _ in zip(env.dataset(0), range(2))]
    groups = [await r.group(Prompt(i, row), f"g{i}", generate) for i, row in enumerate(rows)]
    await r.kind.endpoint.stop()
    episodes = []  # (the row, the episode's samples)
    for row, group in zip(rows, groups):
        assert group.failed == 0 and len(group.episodes) == 2, group
        at = 0
        for e in group.episodes:
            episodes.append((row, group.samples[at:at + e["samples"]]))
            at += e["samples"]
    return {"episodes": episodes, "kept": env.kept}


def recording(generate, seen: dict):
    async def record(request):
        response = await generate(request)
        seen[request.request_id] = (request, response)
        return response

    return record


async def play_tools(generate) -> dict:
    """Two groups of two ShapesTools episodes, three model turns each (a look after each of the
    first two), on the engine behind `generate` (tests/picture_episodes.py). Common characters stop a turn:
    the random model's turns end (finish "stop") before max_tokens, where the loop would stop."""
    env, seen = Recorded(), {}
    stop = list(" eaoinstrlhducmpgybwfkv.,!?12345")  # the 32 stop strings a request may have
    r = turn_rollouts(env, "tasks.shapes_tools:ShapesTools", stop=stop, temperature=1.0)
    groups = [await r.group(Prompt(i, row), f"t{i}", recording(generate, seen))
              for i, row in zip(range(2), env.dataset(0))]
    return {"groups": groups, "conversations": env.conversations, "seen": seen, "eou": r.kind.stop_token_ids}


async def play_turns(generate) -> dict:
    """Two groups of two ShapesTurns episodes (two boards each) on the engine behind `generate`."""
    env, seen = ShapesTurns(), {}
    r = turn_rollouts(env, "tasks.shapes_tools:ShapesTurns", max_turns=2, temperature=1.0)
    rows = [row for _, row in zip(range(2), env.dataset(0))]
    groups = [await r.group(Prompt(i, row), f"x{i}", recording(generate, seen)) for i, row in enumerate(rows)]
    return {"groups": groups, "rows": rows, "seen": seen}


def engine_against_float64(played, images=lambda s: s.images):
    """Per sampled token: (the engine's logprob, float64 transformers' given `images(sample)`,
    the float32 bound for one program: tests/integration/test_vlm_run.py); samples for which
    `images` gives None are left out."""
    from float32_rounding import U
    from vlm_checks import exact_logprobs, float64_model, vlm_logit_error

    vision, error = float64_model(), vlm_logit_error()
    out = []
    for _, samples in played["episodes"]:
        for s in samples:
            if images(s) is None:
                continue
            lp, scale = exact_logprobs(vision, s.tokens, images(s), s.versions)
            for t in range(1, len(s.tokens)):
                if s.loss_mask[t]:
                    out.append((s.logprobs[t], float(lp[t - 1, s.tokens[t]]),
                                2 * error * float(scale[t - 1]) + abs(s.logprobs[t]) * U))
    return out


PLAYED: dict = {}


def played_on_engine(tmp_path_factory) -> dict:
    """{"agent": ..., "tools": ..., "turns": ..., "tmp": a folder}: what each module's player
    returned (play_agents, play_tools and play_turns)."""
    if PLAYED:
        return PLAYED
    import aiohttp

    from rl.inference_api import InferenceClient
    from programs import launch_server, wait_healthy

    tmp = tmp_path_factory.mktemp("vlm_engine")
    proc, url = launch_server(tmp, "server", VLM, tmp / "run", seq_len=SEQ_LEN)
    try:
        wait_healthy(proc, url)

        async def main() -> dict:
            async with aiohttp.ClientSession() as session:
                client = InferenceClient(url, session)

                async def generate(request):
                    return await client.generate(request, timeout=120)

                return {"agent": await play_agents(generate), "tools": await play_tools(generate),
                        "turns": await play_turns(generate)}

        PLAYED.update(asyncio.run(main()), tmp=tmp)
    finally:
        proc.stop()
    return PLAYED
