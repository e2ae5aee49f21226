"""The server's calls to its workers: every worker's answer, across data-parallel engines too, and
a reload that every worker takes or none does (staged; the workers' side is staging.py).

Why not AsyncLLM.collective_rpc alone: it goes through the engine core client's
call_utility_async, which a data-parallel server's client (vLLM 0.32 DPLBAsyncMPClient,
v1/engine/core_client.py) sends to every engine but answers with engine 0's workers only. A
refusal, or a failure, on another rank would pass unseen, and the server would label that rank's
weights with a version they are not. call_utility_all_async answers with every engine's list
(tests/inference/test_vllm_contract.py pins both).
"""

from __future__ import annotations

import logging

from fastapi import HTTPException

log = logging.getLogger("inference")


class Refused(Exception):
    """A version some worker refused before any worker touched the engine: it still serves what
    it served."""


def timed_out(e: Exception) -> bool:
    text = str(e).lower()
    return isinstance(e, TimeoutError) or "timeout" in text or "timed out" in text


def may_still_run(e: Exception) -> bool:
    """Whether the worker call that raised `e` may still be running: the call timed out (a
    TimeoutError, or a 504) rather than the worker answering with an error. vLLM 0.32's
    multiprocess executor (the CPU backend's, and every multi-GPU one) gives up waiting after its
    timeout, but the worker goes on, and its answer stays queued for the next collective_rpc to
    take as its own (v1/executor/multiproc_executor.py: collective_rpc, get_response). A worker
    that did answer with an error is "Worker failed with error ..." there, whatever its text."""
    if isinstance(e, HTTPException):
        out, text = e.status_code == 504, str(e.detail)
    else:
        out, text = timed_out(e), str(e)
    return out and "Worker failed with error" not in text


async def every_worker(engine, method: str, timeout_s: float | None = None, args: tuple = ()) -> list:
    """Each worker's answer to the worker extension's `method`, engine by engine."""
    core = getattr(engine, "engine_core", None)
    if hasattr(core, "call_utility_all_async"):
        # The engine core's collective_rpc utility takes (method, timeout, args, kwargs).
        per_engine = await core.call_utility_all_async("collective_rpc", method, timeout_s, args, None)
        return [answer for answers in per_engine for answer in answers]
    return await engine.collective_rpc(method, timeout=timeout_s, args=args)


async def staged(engine, stage: str, timeout_s: float, arg: str) -> list[dict]:
    """Every worker stages (reads and checks) the version `arg` names with `stage`; then all
    load it (asyncrl_commit), or, when any refused, none does (asyncrl_discard) and Refused says
    why in one line. Returns each worker's commit answer."""
    try:
        answers = await every_worker(engine, stage, timeout_s, (arg,))
    except Exception as e:
        # A worker failed while others may hold a patched base: every one drops what it holds,
        # unless the call may still run (another call would take its answer for its own).
        if not may_still_run(e):
            await discard_quietly(engine, timeout_s)
        raise
    refused = [(i, a["refused"]) for i, a in enumerate(answers) if a.get("refused")]
    if refused:
        await every_worker(engine, "asyncrl_discard", timeout_s)
        worker, why = refused[0]
        if len(answers) > 1:
            why = f"{why} (worker {worker}; {len(refused)} of {len(answers)} workers refused, none loaded it)"
        raise Refused(why)
    return await every_worker(engine, "asyncrl_commit", timeout_s)


async def discard_quietly(engine, timeout_s: float) -> None:
    try:
        await every_worker(engine, "asyncrl_discard", timeout_s)
    except Exception as e:  # the stage's error is the one to answer; the rollback reloads anyway
        log.warning("dropping a staged version after a failed stage failed too: %s", str(e)[:300])
