"""Scoring is an interface: a reward is a Python callable, an HTTP endpoint, or nothing; a
teacher model adds a per-token signal (on-policy distillation). The rest of the pipeline only
sees numbers.

A reward that raises or times out fails that one rollout (None here); the caller counts it and
the run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import logging
from collections.abc import Callable

import aiohttp

from rl.inference_api import GenerateRequest, InferenceClient, InferenceError

log = logging.getLogger("orchestrator")


def load_callable(spec: str, key: str) -> Callable:
    """Resolve "package.module:name"; errors name the config key."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{key}: {spec!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key}: {module_name!r} has no callable {attr!r}")
    return fn


class Reward:
    """Scores a group's completions; returns one float or None (failed) per completion."""

    def __init__(self, spec: str, timeout_s: float, session: aiohttp.ClientSession, inline: bool = False):
        self.spec, self.timeout_s, self.session, self.inline = spec, timeout_s, session, inline
        self.url = spec if spec.startswith(("http://", "https://")) else None
        self.fn = None if self.url else load_callable(spec, "orchestrator.reward")
        self.is_async = self.fn is not None and inspect.iscoroutinefunction(self.fn)
        # Its own threads: hung rewards can exhaust this pool (their rollouts then time out
        # and fail, loudly) but never the loop's default executor the batch writes use.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="reward")

    async def score(self, prompt: str, completions: list[str], row: dict) -> list[float | None]:
        if self.url:
            return list(await asyncio.gather(*(self._http(prompt, c, row) for c in completions)))
        if self.is_async:
            return list(await asyncio.gather(*(self._async(prompt, c, row) for c in completions)))
        if self.inline:
            return self._sync_all(prompt, completions, row)
        # One thread hop per group, not per completion: a slow or hung reward cannot stall the
        # event loop, and the timeout still applies (the thread is abandoned, the rollouts fail).
        try:
            loop = asyncio.get_running_loop()
            return await asyncio.wait_for(loop.run_in_executor(self.pool, self._sync_all, prompt, completions, row),
                                          self.timeout_s)
        except TimeoutError:
            log.warning("reward %s timed out after %.0f s (orchestrator.reward_timeout_s)", self.spec, self.timeout_s)
            return [None] * len(completions)

    def _sync_all(self, prompt: str, completions: list[str], row: dict) -> list[float | None]:
        out = []
        for c in completions:
            try:
                out.append(float(self.fn(prompt, c, row)))
            except Exception as e:
                log.warning("reward %s raised %s: %s", self.spec, type(e).__name__, e)
                out.append(None)
        return out

    async def _async(self, prompt: str, completion: str, row: dict) -> float | None:
        try:
            return float(await asyncio.wait_for(self.fn(prompt, completion, row), self.timeout_s))
        except Exception as e:
            log.warning("reward %s failed: %s: %s", self.spec, type(e).__name__, e)
            return None

    async def _http(self, prompt: str, completion: str, row: dict) -> float | None:
        try:
            async with self.session.post(self.url, json={"prompt": prompt, "completion": completion, "row": row},
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                r.raise_for_status()
                return float((await r.json())["reward"])
        except Exception as e:
            log.warning("reward endpoint %s failed: %s: %s", self.url, type(e).__name__, e)
            return None


class TeacherError(Exception):
    """The teacher server failed; the group is requeued, the policy server stays in rotation."""


class Teacher:
    """A teacher model on its own inference server. For on-policy distillation the student's
    own tokens are scored: the teacher's logprob of each sampled token minus the student's is a
    per-token estimate of -KL(student || teacher), maximised by the policy gradient."""

    def __init__(self, client: InferenceClient, coef: float, timeout_s: float):
        self.client, self.coef, self.timeout_s = client, coef, timeout_s

    async def logprobs(self, request_id: str, tokens: list[int]) -> list[float | None]:
        try:
            response = await self.client.generate(GenerateRequest(
                request_id=request_id, prompt_token_ids=tokens, max_tokens=1, temperature=1.0,
                prompt_logprobs=True), self.timeout_s)
        except InferenceError as e:  # not the policy server's fault: must not take it out of rotation
            raise TeacherError(str(e)) from None
        if response.prompt_logprobs is None or len(response.prompt_logprobs) != len(tokens):
            raise ValueError(f"teacher {self.client.url} returned no prompt logprobs for {len(tokens)} tokens")
        return response.prompt_logprobs

    def advantages(self, teacher_lp: list[float | None], logprobs: list[float], loss_mask: list[int]) -> list[float]:
        return [self.coef * (t - s) if m and t is not None else 0.0
                for t, s, m in zip(teacher_lp, logprobs, loss_mask)]
