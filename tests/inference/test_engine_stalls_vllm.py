"""What the orchestrator and the server do when work on a real vLLM engine must stop or stalls,
against real `rl inference` servers (the stand-in versions are in tests/orchestrator/test_scheduling.py):

- groups no batch can take any more are aborted *on the engine*: the server stops their engine
  requests while they run (its /health "aborted" counts them), their prompts go back to the queue;
- a request that outlives orchestrator.timeouts.request_s is aborted on the engine, its prompt
  requeued, the server taken out of rotation and back;
- a reload that outlives inference.timeouts.reload_s answers 504 on time, /health says 503 while
  it still runs, and the server serves the new version once it ends.

An engine is made slow by stopping its engine-core process (SIGSTOP) and letting it go again
(SIGCONT): a hang of the engine itself, which no timeout inside vLLM covers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from conftest import TINY_MODEL
from engine_processes import engine_core
from orchestrator.orchestrator import Orchestrator
from orchestrator.servers.delivery import ANSWER_MARGIN_S
from programs import launch_server, wait_healthy
from rl.inference_api import connector
from rl.rundir import RunDir, mark_stable
from scenarios import Collect, copying_trainer, make_config


pytestmark = pytest.mark.slow

SEQ_LEN = 256  # the tiny model's max_position_embeddings
RELOAD_TIMEOUT_S = 3
LONG_SEQ_LEN = 2048
# Near-greedy, the tiny model writes "z" after "z" until the length limit (up to 2,040 tokens
# with its positions raised to 2,048: checked), and ends "abc=" after 4 tokens: long and short
# groups, in a known order.
LONG, SHORT = "z", "abc="
ORDER = [LONG, SHORT, SHORT, LONG]  # then SHORT for ever


def rows(seed: int) -> Iterator[dict]:
    """The dataset (its function = "test_engine_stalls_vllm:rows")."""
    i = 0
    while True:
        yield {"prompt": ORDER[i] if i < len(ORDER) else SHORT, "index": i}
        i += 1


def only_long(seed: int) -> Iterator[dict]:
    while True:
        yield {"prompt": LONG}


@pytest.fixture
def server(tmp_path):
    proc, url = launch_server(tmp_path, "server", TINY_MODEL, tmp_path / "run", seq_len=SEQ_LEN,
                              extra=f"timeouts.reload_s = {RELOAD_TIMEOUT_S}\n")
    try:
        wait_healthy(proc, url)
        yield proc, url
    finally:
        proc.stop()


@pytest.fixture
def long_server(tmp_path):
    """The tiny model allowed 2,048 positions (RoPE has no limit of its own): a long group then
    writes 2,040 tokens: 8.6 s for 8 samples on an idle build machine, while the short groups,
    two hand-overs and a reload take a fraction of a second (with 250 tokens a loaded machine
    once finished the long groups first)."""
    model = tmp_path / "long-model"
    shutil.copytree(TINY_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG_SEQ_LEN}))
    proc, url = launch_server(tmp_path, "server", model, tmp_path / "run", seq_len=LONG_SEQ_LEN)
    try:
        wait_healthy(proc, url)
        yield model, url, proc
    finally:
        proc.stop()


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


async def poll(what: str, check, timeout_s: float, every_s: float = 0.05):
    """`await check()` until it returns something other than None or False; that value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await check()
        if value is not None and value is not False:  # 0 is an answer
            return value
        await asyncio.sleep(every_s)
    raise AssertionError(f"no {what} within {timeout_s:g} s")


def orchestrator_config(root: Path, url: str, rows: str, max_steps: int = 6, model: Path = TINY_MODEL,
                        seq_len: int = SEQ_LEN, **tables):
    """`rows`: the dataset's function; `tables`: tables of [orchestrator] (make_config joins them
    to its defaults)."""
    port = int(url.rsplit(":", 1)[1])
    return make_config(root, [port], model=str(model), seq_len=seq_len, max_async_level=1, max_steps=max_steps,
                       orchestrator={"sampling": {"max_tokens": seq_len - 2, "temperature": 0.05},
                                     "datasets": [{"name": "data", "function": rows, "reward": "fake_inference:reward"}],
                                     **tables, "timeouts": {"weights_s": 120, **tables.get("timeouts", {})}})


def test_hopeless_groups_are_aborted_on_the_engine(long_server, tmp_path):
    """Groups of 8 on LONG, SHORT, SHORT, LONG start on version 0 (two batches of two may still
    take version 0 with max_off_policy_steps 1). The short ones make batch 1; the trainer stand-in
    publishes version 1, reloaded while the long ones run; two more short groups make batch 2.
    Batch 3 can take no version-0 token, so the two long groups, still generating, are cancelled:
    the server aborts all 16 of their engine requests while they run, and their prompts go back to
    the queue. (That an aborted engine request stops generating: test_inference_server.py's abort
    test.)

    "Still generating" by construction, not by a race against the clock: the engine core runs
    (SIGCONT) only while a short group's request is on the server or a reload is under way, and
    is stopped (SIGSTOP) otherwise. The long groups then advance only during the engine steps the
    short groups and reloads need (a few dozen: 4 tokens a short group), never the 2,040 they
    need to end; everything else (hand-overs, the trainer stand-in, scoring, a loaded machine's
    stalls) happens while the engine is stopped. (Before: the engine ran throughout, and on a
    loaded machine the long groups once ended, their answers on the way back, as the abort went
    out: nothing left on the engine to abort.)"""
    model, url, proc = long_server
    root = tmp_path / "run"
    group_size = 8
    long_rows = {i for i, p in enumerate(ORDER) if p == LONG}
    cfg = orchestrator_config(root, url, model=model, seq_len=LONG_SEQ_LEN,
                              rows="test_engine_stalls_vllm:rows", max_steps=2,
                              scheduling={"group_size": group_size, "prompts_per_step": 2, "max_in_flight_groups": 4,
                                          "max_off_policy_steps": 1, "in_flight_updates": True},
                              timeouts={"request_s": 60})
    RunDir(root).make()
    core = engine_core(proc)
    seen = {}

    async def scenario():
        async with aiohttp.ClientSession(connector=connector()) as session:
            async def state() -> dict:
                async with session.get(f"{url}/health") as r:
                    return await r.json()

            orch = Orchestrator(cfg, session)
            cancel_hopeless = orch.cancel_hopeless
            reloading = [0]

            def engine_running(reload):  # a reload needs the engine core
                async def wrapped(*args):
                    reloading[0] += 1
                    try:
                        return await reload(*args)
                    finally:
                        reloading[0] -= 1
                return wrapped

            def engine_needed() -> bool:
                return reloading[0] > 0 or any(g.requests for g in orch.in_flight.values()
                                               if g.prompt.index not in long_rows)

            async def gate() -> None:
                stopped = False
                try:
                    while True:
                        if engine_needed() == stopped:
                            core.send_signal(signal.SIGCONT if stopped else signal.SIGSTOP)
                            stopped = not stopped
                        await asyncio.sleep(0.002)
                finally:
                    core.send_signal(signal.SIGCONT)

            async def observed() -> None:
                doomed = {gid: g.prompt.index for gid, g in orch.in_flight.items()}
                drawn = orch.queue.cursor
                before = await state()
                await cancel_hopeless()
                if orch.next_step != 3:
                    return
                seen["doomed"] = {gid: i for gid, i in doomed.items() if gid not in orch.in_flight}
                # Requeued, or already taken again by a group started while the aborts were out
                # (a prompt drawn before the cancellation).
                seen["requeued"] = [p.index for p in orch.queue.requeued] + [
                    g.prompt.index for gid, g in orch.in_flight.items()
                    if gid not in doomed and g.prompt.index < drawn]
                seen["running before"] = before["running"]
                # Counted as the server passes them to the engine, before it answers the /abort
                # that cancel_hopeless awaited: exact now.
                seen["aborted"] = (await state())["aborted"] - before["aborted"]

            orch.cancel_hopeless = observed
            # load: every server to a new version; bring: one server back (health checks).
            orch.delivery.load = engine_running(orch.delivery.load)
            orch.delivery.load_one = engine_running(orch.delivery.load_one)
            gating = asyncio.create_task(gate())
            trainer = asyncio.create_task(copying_trainer(RunDir(root), cfg.max_steps))
            try:
                await asyncio.wait_for(orch.run(), 240)
            finally:
                trainer.cancel()
                gating.cancel()
                await asyncio.gather(gating, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        core.send_signal(signal.SIGCONT)
    # The gate held: the long groups' 16 engine requests were still on the engine when the abort went.
    assert seen["running before"] >= 2 * group_size, seen
    assert sorted(seen["doomed"].values()) == sorted(long_rows), seen  # the two long groups, nothing else
    assert sorted(seen["requeued"]) == sorted(long_rows), seen
    assert seen["aborted"] == 2 * group_size, seen


def test_a_reload_that_outlives_its_timeout_answers_504_and_the_server_recovers(server, tmp_path):
    proc, url = server
    version_1 = RunDir(tmp_path / "run").weights_dir(1)
    shutil.copytree(TINY_MODEL, version_1)
    mark_stable(version_1)
    core = engine_core(proc)
    core.send_signal(signal.SIGSTOP)
    try:
        # As the orchestrator asks (delivery.py): it waits the server's timeouts.reload_s plus
        # ANSWER_MARGIN_S for the answer, so an answer the orchestrator would miss fails here too.
        start = time.monotonic()
        r = httpx.post(f"{url}/update_weights", timeout=RELOAD_TIMEOUT_S + ANSWER_MARGIN_S,
                       json={"path": str(version_1), "version": 1, "mode": "keep"})
        took = time.monotonic() - start
        assert r.status_code == 504, r.text
        assert f"still running after {RELOAD_TIMEOUT_S} s (inference.timeouts.reload_s)" in r.text, r.text
        # Not early: the server's wait lies inside the client's. (The engine stays stopped until
        # the finally below, so the reload cannot have ended: only that timeout answers.)
        assert took >= RELOAD_TIMEOUT_S, took
        stuck = health(url)
        assert stuck.status_code == 503 and "still running" in stuck.text, stuck.text
        again = httpx.post(f"{url}/update_weights", timeout=30, json={"path": str(version_1), "version": 1})
        assert again.status_code == 503, again.text
    finally:
        core.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while (h := health(url)).status_code != 200:
        assert time.monotonic() < deadline, h.text
        time.sleep(0.2)
    assert h.json()["version"] == 1
    r = httpx.post(f"{url}/generate", timeout=60, json={"request_id": "after", "prompt_token_ids": [3, 4],
                                                        "max_tokens": 4, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert set(r.json()["samples"][0]["versions"]) == {1}
    assert "the overdue reload of" in proc.tail() and "finished after" in proc.tail()


def test_a_request_that_outlives_its_timeout_is_aborted_on_the_engine_and_requeued(server, tmp_path):
    """The engine stops while groups generate: each request times out (timeouts.request_s 2), is
    aborted on the server while the engine still holds it, its prompt requeued, the server taken
    out of rotation; once the engine goes on, the server is back in rotation."""
    proc, url = server
    root = tmp_path / "run"
    group_size = 4
    cfg = orchestrator_config(root, url, rows="test_engine_stalls_vllm:only_long",
                              scheduling={"group_size": group_size, "prompts_per_step": 2, "max_in_flight_groups": 2},
                              timeouts={"request_s": 2}, servers={"retry_max_s": 1})
    RunDir(root).make()
    core = engine_core(proc)
    warnings = Collect()
    logging.getLogger("orchestrator").addHandler(warnings)

    async def scenario():
        async with aiohttp.ClientSession(connector=connector()) as session:
            async def state() -> dict:
                async with session.get(f"{url}/health") as r:
                    return await r.json() if r.status == 200 else {}

            orch = Orchestrator(cfg, session)
            run = asyncio.create_task(orch.run())
            try:
                await poll("groups generating", lambda: _running(state, 2 * group_size), 60, every_s=0.01)
                core.send_signal(signal.SIGSTOP)
                try:
                    stalled = {gid: g.prompt.index for gid, g in orch.in_flight.items()}
                    aborted_before = (await state())["aborted"]
                    await poll("the stalled groups given back", lambda: _given_back(orch, stalled), 30)
                    # Requeued, or already taken again by a new group (the server may be back in
                    # rotation: its front end answers /health while the engine is stopped).
                    requeued = [p.index for p in orch.queue.requeued]
                    requeued += [g.prompt.index for gid, g in orch.in_flight.items() if gid not in stalled]
                finally:
                    core.send_signal(signal.SIGCONT)
                # New groups on the stopped engine may time out too: at least the stalled ones.
                want = aborted_before + group_size * len(stalled)
                aborted = await poll("aborts", lambda: _aborted_at_least(state, want), 30) - aborted_before
                await poll("the server back in rotation", lambda: _healthy(orch), 30)
                return stalled, requeued, aborted
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)

    try:
        stalled, requeued, aborted = asyncio.run(scenario())
    finally:
        logging.getLogger("orchestrator").removeHandler(warnings)
    assert len(stalled) == 2, stalled
    assert set(stalled.values()) <= set(requeued), (stalled, requeued)
    assert aborted >= group_size * len(stalled)
    out = [w for w in warnings.lines if f"server {url} out of rotation" in w]
    assert out and "/generate: no answer in 2 s" in out[0], warnings.lines


async def _running(state, want: int) -> bool:
    return (await state()).get("running", 0) >= want


async def _given_back(orch: Orchestrator, stalled: dict[str, int]) -> bool:
    return not stalled.keys() & orch.in_flight.keys()


async def _aborted_at_least(state, want: int) -> int | None:
    value = (await state()).get("aborted", 0)
    return value if value >= want else None


async def _healthy(orch: Orchestrator) -> bool:
    return orch.pool.servers[0].healthy
