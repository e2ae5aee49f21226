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
- A reload that outlived inference.timeouts.reload_s (its caller got 504) and then fails: no
  rollback, the server is broken. Nor is there one after a load that timed out (a stand-in
  engine): vLLM's multiprocess executor leaves the worker loading, and a second call to it would
  take the first one's answer for its own.

"Frozen across the update" by construction, not by a race against the clock: the engine runs in
short slices until vLLM's /metrics gauge, read while its engine core is stopped (SIGSTOP), shows it
holding the long request (a request that ended first, on a starved test process, is sent again);
the update goes out, and the core is let go (SIGCONT) once the server logged that it pauses the
engine; the worker's failure line says how many requests it held.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from fastapi import HTTPException
from safetensors.torch import load_file, save_file

from conftest import TINY_MODEL
from engine_processes import engine_core
from inference.access import WeightRoots
from inference.adapters import AdaptersOff
from inference.generation import Generations
from inference.reload import ServedWeights
from inference.reload_failure import Overdue
from inference.reload_kinds import FilesReload
from programs import launch_server, wait_healthy
from rl.config import load_config
from rl.inference_api import UpdateWeightsRequest, connector
from rl.rundir import RunDir, mark_stable


SEQ_LEN = 1024  # the tiny model allowed 1,024 positions: a long greedy request runs for a second or more
Z = 28  # "z": greedy, the tiny model writes "z" after "z" until max_tokens
LONG = {"prompt_token_ids": [Z], "max_tokens": SEQ_LEN - 8, "temperature": 0}
PROMPTS = ([3, 4, 5, 29], [10, 11, 29], [Z, 27, 26, 25, 29])
# Alphabetical, as the loader reads them: the embedding and layers 0-1 come before it.
BAD = "model.layers.2.input_layernorm.weight"


RELOAD_TIMEOUT_S = 3
ATTEMPTS = 5  # long requests sent until the engine is seen holding one (held_by_stopped_engine)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server at a time for the module, on a copy of the tiny model allowed SEQ_LEN positions:
    a test that leaves it serving (a rollback) hands it on to the next, and only one that broke
    it, failed, or asks for another [inference] config starts a new one (vLLM's start is most of
    a case's time here)."""
    tmp = tmp_path_factory.mktemp("reload")
    model = tmp / "model"
    shutil.copytree(TINY_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": SEQ_LEN}))
    held = {}
    try:
        yield tmp, model, RunDir(tmp / "run"), held
    finally:
        if held:
            held["proc"].stop()


@pytest.fixture
def setup(served, request):
    """The module's server serving version 1 (fresh files for versions 1-3, whatever the last test
    did to them); with indirect parametrization, request.param is more of its [inference] config.
    Yields the server, its url, the versions and where this test's part of the server log begins
    (the log runs on across tests: `since` reads this test's part)."""
    tmp, model, run, held = served
    extra = getattr(request, "param", "")
    if held and (held["extra"] != extra or not still_serving(held["url"])):
        held.pop("proc").stop()
        held.clear()
    for v in (1, 2, 3):
        shutil.rmtree(run.weights_dir(v), ignore_errors=True)
    versions = {1: weights(run, model, 1, seed=1),
                2: weights(run, model, 2, seed=2, misshapen=BAD),
                3: weights(run, model, 3, seed=2)}
    if not held:
        proc, url = launch_server(tmp, "server", model, run.root, seq_len=SEQ_LEN, extra=extra)
        held.update(proc=proc, url=url, extra=extra)
        wait_healthy(proc, url)
    proc, url = held["proc"], held["url"]
    offset = proc.log.stat().st_size
    status, answer = asyncio.run(update(url, versions[1], 1))
    assert status == 200, answer
    failed = request.session.testsfailed
    yield proc, url, versions, offset
    if request.session.testsfailed != failed:  # a failed case may have left it in any state
        held.pop("proc").stop()
        held.clear()


def still_serving(url: str) -> bool:
    """/health answers 200: not broken (a broken server answers 503 for good)."""
    async def ask():
        async with aiohttp.ClientSession(connector=connector()) as s:
            return (await health(s, url))[0]
    return asyncio.run(ask()) == 200


def since(proc, offset: int) -> str:
    """The server's log from `offset` on: this test's part."""
    with open(proc.log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


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
    async with aiohttp.ClientSession(connector=connector()) as s:
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


async def engine_running(s: aiohttp.ClientSession, url: str) -> float:
    """vLLM's own gauge (/metrics): how many requests the engine has scheduled."""
    async with s.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


async def held_by_stopped_engine(s: aiohttp.ClientSession, url: str, core, task: asyncio.Task,
                                 slices: int = 200) -> bool:
    """True with the engine core stopped (SIGSTOP) while it holds `task`'s request; False, the
    engine running, if the request ended before it was seen there. The engine runs in short
    slices (SIGCONT, a moment, SIGSTOP), and the gauge is read only while it is stopped, after
    the server had time to take in its last outputs. A slice ends when this process wakes,
    though, and beside a busy loop it once woke 2.7 s late, time enough for all ~1,000 decode
    steps: the caller tries again (before: the gauge was polled while the engine ran freely,
    and beside a busy loop the request ended between two polls)."""
    core.send_signal(signal.SIGSTOP)
    for _ in range(slices):
        await asyncio.sleep(0.2)  # the server takes in the outputs of the last slice
        if task.done():
            core.send_signal(signal.SIGCONT)
            return False
        if await engine_running(s, url) >= 1:
            return True
        core.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.02)
        core.send_signal(signal.SIGSTOP)
    core.send_signal(signal.SIGCONT)
    raise AssertionError(f"no request running on the engine after {slices} slices")


async def long_across_update(s: aiohttp.ClientSession, proc, url: str, path: Path,
                             version: int) -> tuple[dict, tuple]:
    """A long greedy request, and the update of `path` as `version` in mode "keep" (the request
    frozen between two decode steps) while it runs, surely: the engine core is stopped while it
    holds the request until the server pauses the engine for the update. (Before: a race; on a
    fast machine the request could end before the update.) (its sample, the update's answer)."""
    core = engine_core(proc)
    for attempt in range(ATTEMPTS):  # a setup condition, tried again: not what the test checks
        long = asyncio.create_task(generate(s, url, f"long-across-{attempt}", **LONG))
        if await held_by_stopped_engine(s, url, core, long):
            break
        await long
    else:
        raise AssertionError(f"the long request ended before the engine was seen holding it, {ATTEMPTS} times")
    try:
        pausing = f"updating to version {version} from {path}: pausing the engine"
        before = proc.log.read_text(errors="replace").count(pausing)
        answer = asyncio.create_task(update(url, path, version))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while proc.log.read_text(errors="replace").count(pausing) == before:
            assert loop.time() < deadline and not answer.done(), f"no update logged:\n{proc.tail()}"
            await asyncio.sleep(0.01)
    finally:
        core.send_signal(signal.SIGCONT)
    answer = await answer
    status, data = await long
    assert status == 200, data
    return data["samples"][0], answer


@pytest.mark.slow
def test_a_reload_failing_half_way_rolls_back_to_the_version_served(setup):
    proc, url, versions, offset = setup

    async def scenario():
        async with aiohttp.ClientSession(connector=connector()) as s:
            before = await greedy(s, url, "before")
            status, data = await generate(s, url, "long-before", **LONG)
            assert status == 200, data
            long_before = data["samples"][0]
            long_across, (status, answer) = await long_across_update(s, proc, url, versions[2], 2)
            return before, long_before, long_across, status, answer, await health(s, url), await greedy(s, url, "after")

    before, long_before, long_across, status, answer, (h_status, h), after = asyncio.run(scenario())
    assert status == 500, answer
    assert "Attempted to load weight (torch.Size([129])) into parameter (torch.Size([128]))" in answer, answer
    assert "rolled back: this server still serves version 1" in answer, answer
    # Half-way indeed: the worker had loaded layers of version 2 before the misshapen tensor.
    log = since(proc, offset)
    loaded, kept = map(int, re.search(r"reload failed half-way: (\d+) layers had taken the new weights, "
                                      r"(\d+) keep their own", log).groups())
    assert loaded > 0 and kept > 0, (loaded, kept)
    held = int(re.search(r"rolled back to version 1 from .* \((\d+) requests held across it\)", log).group(1))
    assert held == 1  # the long request, frozen across it
    assert h_status == 200 and h["version"] == 1 and h["path"] == str(versions[1]), h
    # Exactly version 1's weights: the same greedy tokens and logprobs, tagged 1.
    assert after == before
    assert all(set(sample["versions"]) == {1} for sample in after), after
    # The request frozen across the failed update, resumed on the rolled-back weights.
    assert long_across == long_before
    assert 0 < len(long_across["token_ids"]) == LONG["max_tokens"]
    assert long_before["finish_reason"] == "length" and set(long_before["versions"]) == {1}
    # The engine takes the next good version.
    status, answer = asyncio.run(update(url, versions[3], 3))
    assert status == 200, answer

    async def now():
        async with aiohttp.ClientSession(connector=connector()) as s:
            return await greedy(s, url, "v3")

    v3 = asyncio.run(now())
    assert all(set(sample["versions"]) == {3} for sample in v3) and v3 != before, v3


@pytest.mark.slow
def test_a_failed_rollback_marks_the_server_broken(setup):
    proc, url, versions, offset = setup
    # Version 1's files gone (as a trainer's keep_weights would delete them): nothing to roll back to.
    (versions[1] / "model.safetensors").unlink()

    async def scenario():
        async with aiohttp.ClientSession(connector=connector()) as s:
            long, (status, answer) = await long_across_update(s, proc, url, versions[2], 2)
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
    assert "failed too" in since(proc, offset)


@pytest.mark.slow
@pytest.mark.parametrize("setup", [f"timeouts.reload_s = {RELOAD_TIMEOUT_S}\n"], indirect=True)
def test_an_overdue_reload_that_then_fails_marks_the_server_broken(setup):
    """The engine core stopped past inference.timeouts.reload_s: 504, /health 503 "still running"; let go,
    the load of the misshapen version fails in the worker. Its caller was told 504 and that the
    server answers 503 until the reload ends, so no rollback: the server is broken (before: it
    rolled back after the fact, and with a load that had timed out in vLLM's executor, the
    rollback took the first load's answer for its own)."""
    proc, url, versions, offset = setup
    core = engine_core(proc)
    core.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        status, answer = asyncio.run(update(url, versions[2], 2))
        assert status == 504 and f"still running after {RELOAD_TIMEOUT_S} s" in answer, answer
        assert time.monotonic() - start >= RELOAD_TIMEOUT_S

        async def stuck():
            async with aiohttp.ClientSession(connector=connector()) as s:
                return await health(s, url)

        h_status, h = asyncio.run(stuck())
        assert h_status == 503 and "still running" in h, h
    finally:
        core.send_signal(signal.SIGCONT)

    async def until_broken():
        async with aiohttp.ClientSession(connector=connector()) as s:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while "still running" in (h := await health(s, url))[1]:
                assert loop.time() < deadline, h
                await asyncio.sleep(0.1)
            return (h, await generate(s, url, "after", prompt_token_ids=[3, 4], max_tokens=4, temperature=0),
                    await update(url, versions[3], 3))

    (h_status, h), (g_status, g), (u_status, u) = asyncio.run(until_broken())
    assert (h_status, g_status, u_status) == (503, 503, 503), (h, g, u)
    for text in (h, g, u):
        assert "the overdue reload of " in text and " as version 2 failed after " in text, text  # path: <path> to clients
        assert "Attempted to load weight (torch.Size([129])) into parameter (torch.Size([128]))" in text, text
        assert "the weights are no version's; restart this server" in text, text
    log = since(proc, offset)
    assert "reload failed half-way" in log  # in the worker, after the 504
    assert "rolled back" not in log and "rolling back" not in log


# --- the decision, on a stand-in engine ---------------------------------------------------------

class Engine:
    """What ServedWeights asks of vLLM's AsyncLLM; collective_rpc raises `errors` in turn, then answers."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.calls: list[tuple] = []
        self.resumed = 0
        self.aborted: list[list[str]] = []
        self.labels: list[str] = []

    async def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append((method, args))
        if self.errors:
            raise self.errors.pop(0)
        return [{}]

    async def pause_generation(self, mode, clear_cache):
        pass

    async def update_weight_version(self, label):
        self.labels.append(label)

    async def resume_generation(self):
        self.resumed += 1

    async def reset_prefix_cache(self):
        return True

    async def abort(self, ids):
        self.aborted.append(ids)


def stand_in(tmp_path, engine: Engine) -> ServedWeights:
    served = tmp_path / "served"
    served.mkdir()
    (served / "model.safetensors").write_bytes(b"")
    cfg = load_config(["--model", str(TINY_MODEL)])[0]
    weights = ServedWeights(cfg, WeightRoots(cfg), Generations(cfg.seq_len, AdaptersOff(None, 0)))
    weights.engine = weights.generations.engine = engine
    weights.path, weights.generations.version = str(served), 1
    return weights


def reload_to(weights: ServedWeights, tmp_path) -> HTTPException:
    body = UpdateWeightsRequest(path=str(tmp_path / "v2"), version=2, mode="keep")
    with pytest.raises(HTTPException) as e:
        asyncio.run(weights.update(FilesReload(3), tmp_path / "v2", body))
    return e.value


# How vLLM 0.32's AsyncLLM raises a collective_rpc its multiprocess executor gave up on, and one a
# worker answered with an error (v1/engine/core_client.py _process_utility_output).
TIMED_OUT = Exception("Call to collective_rpc method failed: RPC call to asyncrl_reload_weights timed out.")
WORKER_FAILED = Exception("Call to collective_rpc method failed: Worker failed with error 'Attempted to load "
                          "weight (torch.Size([129])) into parameter (torch.Size([128]))', please check the stack "
                          "trace above for the root cause")


@pytest.mark.parametrize("error", [TIMED_OUT, TimeoutError(), HTTPException(504, "receiving version 2 by broadcast "
                                                                                 "failed: RPC call timed out.")],
                         ids=["rpc-timeout", "TimeoutError", "broadcast-504"])
def test_a_load_that_timed_out_is_not_rolled_back(tmp_path, error):
    """The worker may still be loading: no second call (it would take the first one's answer),
    the engine left paused, the server broken."""
    engine = Engine(error)
    weights = stand_in(tmp_path, engine)
    weights.generations.running["held-0"] = 1
    e = reload_to(weights, tmp_path)
    assert e.status_code == 503 and "timed out" in e.detail and "the weights are no version's; restart" in e.detail
    assert len(engine.calls) == 1 and engine.resumed == 0 and engine.aborted == [["held-0"]]
    assert weights.generations.broken == e.detail and weights.generations.version == 1


def test_a_definite_failure_rolls_back(tmp_path):
    engine = Engine(WORKER_FAILED)
    weights = stand_in(tmp_path, engine)
    e = reload_to(weights, tmp_path)
    assert e.status_code == 500 and "rolled back: this server still serves version 1" in e.detail, e.detail
    assert [m for m, _ in engine.calls] == ["asyncrl_reload_weights"] * 2 and engine.calls[1][1] == (weights.path,)
    assert engine.resumed == 1 and not weights.generations.broken


def test_an_overdue_load_that_fails_is_not_rolled_back(tmp_path):
    engine = Engine(WORKER_FAILED)
    weights = stand_in(tmp_path, engine)
    weights.failures.overdue = Overdue(tmp_path / "v2", 2, time.monotonic() - 5, 3)
    e = reload_to(weights, tmp_path)
    assert e.status_code == 503 and "the overdue reload of" in e.detail and "Attempted to load" in e.detail
    assert len(engine.calls) == 1 and engine.resumed == 0


def test_a_pause_that_times_out_answers_504(tmp_path):
    engine = Engine()

    async def pause_generation(mode, clear_cache):
        raise TimeoutError

    engine.pause_generation = pause_generation
    weights = stand_in(tmp_path, engine)
    e = reload_to(weights, tmp_path)
    assert e.status_code == 504 and "timed out" in e.detail, e.detail
    assert engine.calls == [] and not weights.generations.broken
