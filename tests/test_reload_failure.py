"""A weight update that fails half-way, on a real vLLM server (`rl inference`): the server never
serves weights that no version names.

vLLM reloads layer by layer, so a directory whose tensors are fine up to some layer and then
misshapen leaves the engine part new, part old when the load raises (the worker says how many
layers took the new weights). Before the rollback existed, /health went on naming the old
version, and the next /generate killed the engine (layers still on vLLM's meta device).

- The server rolls back: /update_weights answers the error, /health names the old version, and
  greedy outputs, logprobs and per-token versions are exactly those of the old version, for a new
  request and for one that was running (frozen, mode "keep") across the failed update; the next
  good update loads.
- The rollback fails too (the old version's files are gone): the server is broken: /health,
  /generate and /update_weights answer 503 saying why and to restart it; the request the engine
  held ends as aborted, tagged with the old version.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_MODEL
from rl.rundir import RunDir, mark_stable
from test_end_to_end import launch_server, wait_healthy

pytestmark = pytest.mark.slow

SEQ_LEN = 1024  # the tiny model allowed 1,024 positions: a long greedy request runs for a second or more
Z = 28  # "z": greedy, the tiny model writes "z" after "z" until max_tokens
LONG = {"prompt_token_ids": [Z], "max_tokens": SEQ_LEN - 8, "temperature": 0}
PROMPTS = ([3, 4, 5, 29], [10, 11, 29], [Z, 27, 26, 25, 29])
# Alphabetical, as the loader reads them: the embedding and layers 0-1 come before it.
BAD = "model.layers.2.input_layernorm.weight"


@pytest.fixture
def setup(tmp_path):
    """A server on a copy of the tiny model allowed SEQ_LEN positions, serving version 1."""
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": SEQ_LEN}))
    run = RunDir(tmp_path / "run")
    versions = {1: weights(run, model, 1, seed=1),
                2: weights(run, model, 2, seed=2, misshapen=BAD),
                3: weights(run, model, 3, seed=2)}
    proc, url = launch_server(tmp_path, "server", model, run.root, seq_len=SEQ_LEN)
    try:
        wait_healthy(proc, url)
        status, answer = asyncio.run(update(url, versions[1], 1))
        assert status == 200, answer
        yield proc, url, versions
    finally:
        proc.stop()


def weights(run: RunDir, model: Path, version: int, seed: int, misshapen: str | None = None) -> Path:
    """weights/step_<version>: the model with every tensor moved by seeded noise; `misshapen`
    one element too long."""
    path = run.weights_dir(version)
    shutil.copytree(model, path)
    tensors = load_file(path / "model.safetensors")
    noise = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        tensors[name] = t + 0.05 * torch.randn(t.shape, generator=noise)
    if misshapen:
        tensors[misshapen] = torch.ones(tensors[misshapen].shape[0] + 1)
    save_file(tensors, path / "model.safetensors")
    mark_stable(path)
    return path


async def update(url: str, path: Path, version: int, mode: str = "keep") -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/update_weights", json={"path": str(path), "version": version, "mode": mode},
                          timeout=aiohttp.ClientTimeout(total=120)) as r:
            return r.status, await r.text()


async def generate(s: aiohttp.ClientSession, url: str, request_id: str, **body) -> tuple[int, dict | str]:
    async with s.post(f"{url}/generate", json={"request_id": request_id, **body},
                      timeout=aiohttp.ClientTimeout(total=120)) as r:
        return r.status, await r.json() if r.status == 200 else await r.text()


async def greedy(s: aiohttp.ClientSession, url: str, tag: str) -> list[dict]:
    """Each prompt's greedy sample (tokens, logprobs, versions)."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        status, data = await generate(s, url, f"{tag}-{i}", prompt_token_ids=list(prompt), max_tokens=16,
                                      temperature=0)
        assert status == 200, data
        out.append(data["samples"][0])
    return out


async def health(s: aiohttp.ClientSession, url: str) -> tuple[int, dict | str]:
    async with s.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return r.status, await r.json() if r.status == 200 else await r.text()


async def running(s: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    """Until the server's engine holds a request (its /health "running")."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await health(s, url))[1]["running"] < 1:
        assert loop.time() < deadline, f"no request running within {timeout_s:g} s"
        await asyncio.sleep(0.01)


async def long_across_update(s: aiohttp.ClientSession, url: str, path: Path, version: int) -> tuple[dict, tuple]:
    """A long greedy request, and the update of `path` as `version` in mode "keep" (the request
    frozen between two decode steps) while it runs: (its sample, the update's answer)."""
    long = asyncio.create_task(generate(s, url, "long-across", **LONG))
    await running(s, url)
    answer = await update(url, path, version)
    status, data = await long
    assert status == 200, data
    return data["samples"][0], answer


def test_a_reload_failing_half_way_rolls_back_to_the_version_served(setup):
    proc, url, versions = setup

    async def scenario():
        async with aiohttp.ClientSession() as s:
            before = await greedy(s, url, "before")
            status, data = await generate(s, url, "long-before", **LONG)
            assert status == 200, data
            long_before = data["samples"][0]
            long_across, (status, answer) = await long_across_update(s, url, versions[2], 2)
            return before, long_before, long_across, status, answer, await health(s, url), await greedy(s, url, "after")

    before, long_before, long_across, status, answer, (h_status, h), after = asyncio.run(scenario())
    assert status == 500, answer
    assert "Attempted to load weight (torch.Size([129])) into parameter (torch.Size([128]))" in answer, answer
    assert "rolled back: this server still serves version 1" in answer, answer
    # Half-way indeed: the worker had loaded layers of version 2 before the misshapen tensor.
    loaded, kept = map(int, re.search(r"reload failed half-way: (\d+) layers had taken the new weights, "
                                      r"(\d+) keep their own", proc.log.read_text()).groups())
    assert loaded > 0 and kept > 0, (loaded, kept)
    assert h_status == 200 and h["version"] == 1 and h["path"] == str(versions[1]), h
    # Exactly version 1's weights: the same greedy tokens and logprobs, tagged 1.
    assert after == before
    assert all(set(sample["versions"]) == {1} for sample in after), after
    # The request frozen across the failed update, resumed on the rolled-back weights.
    assert long_across == long_before
    assert long_before["finish_reason"] == "length" and set(long_before["versions"]) == {1}
    # The engine takes the next good version.
    status, answer = asyncio.run(update(url, versions[3], 3))
    assert status == 200, answer

    async def now():
        async with aiohttp.ClientSession() as s:
            return await greedy(s, url, "v3")

    v3 = asyncio.run(now())
    assert all(set(sample["versions"]) == {3} for sample in v3) and v3 != before, v3


def test_a_failed_rollback_marks_the_server_broken(setup):
    proc, url, versions = setup
    # Version 1's files gone (as a trainer's keep_weights would delete them): nothing to roll back to.
    (versions[1] / "model.safetensors").unlink()

    async def scenario():
        async with aiohttp.ClientSession() as s:
            long, (status, answer) = await long_across_update(s, url, versions[2], 2)
            return (long, status, answer, await health(s, url),
                    await generate(s, url, "after", prompt_token_ids=[3, 4], max_tokens=4, temperature=0),
                    await update(url, versions[3], 3))

    long, status, answer, (h_status, h), (g_status, g), (u_status, u) = asyncio.run(scenario())
    assert status == 503, answer
    assert "rolling back to version 1 from" in answer and "failed too" in answer, answer
    for text in (answer, h, g, u):
        assert "the weights are no version's; restart this server" in text, text
    assert (h_status, g_status, u_status) == (503, 503, 503)
    # The request the engine held ends at once, with the tokens version 1 sampled before the pause
    # (none, when the update came before its first step).
    assert long["finish_reason"] == "abort" and len(long["token_ids"]) < LONG["max_tokens"], long
    assert set(long["versions"]) <= {1}, long
    assert "failed too" in proc.log.read_text()
