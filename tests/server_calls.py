"""Calls a test makes to a real server over aiohttp: a JSON post and its answer, and a wait on
vLLM's own gauge of requests the engine runs (/metrics). Shared by the inference-server and
OpenAI chat-tools tests."""

from __future__ import annotations

import asyncio
import time

import aiohttp


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


async def wait_running(s, url: str, done, timeout: float = 30.0,
                       task: asyncio.Task | None = None) -> float | None:
    """Poll vLLM's own gauge of requests the engine runs (Prometheus /metrics) until
    done(count); returns the seconds it took, or None if `task` ended first."""
    start = time.perf_counter()
    while True:
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
        count = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vllm:num_requests_running{"))
        if done(count):
            return time.perf_counter() - start
        if task is not None and task.done():
            return None
        assert time.perf_counter() - start < timeout, f"vllm:num_requests_running stuck at {count}"
        await asyncio.sleep(0.005)
