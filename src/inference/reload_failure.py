"""What an update that failed, or outlived its timeout, leaves on the server, and what the server
says about it. The update itself is reload.py's (ServedWeights.switch_to): it hands a failed load
here, the engine still paused.

- A definite failure (the workers answered with an error) is rolled back: the version served
  before is loaded again from its own files, and the server serves it exactly as before.
- A load that may still run (it timed out), one whose caller was already told 504 (Overdue), or a
  rollback that fails too leaves weights that are no version's: the server is broken, and says
  so with 503 on /health, /generate and /update_weights for good (Generations.broken).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from fastapi import HTTPException

from inference.all_workers import may_still_run
from inference.generation import Generations
from inference.reload_kinds import FilesReload

log = logging.getLogger("inference")


@dataclass(frozen=True)
class Overdue:
    """An update still running after its timeout (its caller got 504)."""

    path: Path
    version: int
    since: float
    """time.monotonic() when the update started."""
    timeout_s: float


class ReloadFailures:
    """The server's record of updates gone wrong: an overdue one still running, and the rollback
    or break-down of a failed load. `files` reloads the version served before (a FilesReload, or
    DeltaFiles with weight_sync.delta)."""

    def __init__(self, generations: Generations, files: FilesReload):
        self.generations = generations
        self.files = files
        self.overdue: Overdue | None = None

    def check_not_overdue(self) -> None:
        """503 while an update that outlived its timeout still runs (the weights are mid-load), and
        for good once the weights are no version's (Generations.broken)."""
        if self.generations.broken:
            raise HTTPException(503, self.generations.broken)
        o = self.overdue
        if o is not None:
            raise HTTPException(503, f"reload of {o.path} as version {o.version} still running after "
                                     f"{time.monotonic() - o.since:.0f} s (inference.timeouts.reload_s = "
                                     f"{o.timeout_s:g}); the weights are mid-load")

    def finished_late(self, update: asyncio.Task) -> None:
        o, self.overdue = self.overdue, None
        took = time.monotonic() - o.since
        gens = self.generations
        if update.cancelled():
            # Nobody waits for its answer any more: /health keeps saying it, so that no one is
            # served by weights that may be half old, half new.
            if not gens.broken:
                gens.broken = (f"the overdue reload of {o.path} as version {o.version} was cancelled after "
                               f"{took:.0f} s; the weights are no version's; restart this server")
                log.error("%s", gens.broken)
        elif update.exception() is not None:
            if gens.broken:
                # A load that failed or timed out after the 504: switch_to marked the server broken.
                log.error("the overdue reload of %s as version %d failed after %.0f s: this server is broken",
                          o.path, o.version, took)
            else:
                # It failed before it touched the weights (the lock, the pause), or after they
                # were all loaded (switch_to records the version first).
                log.warning("the overdue reload of %s as version %d failed after %.0f s (%s); serving version %d",
                            o.path, o.version, took, getattr(update.exception(), "detail", update.exception()),
                            gens.version)
        else:
            log.warning("the overdue reload of %s as version %d finished after %.0f s; serving it", o.path,
                        o.version, took)

    async def load_failed(self, engine, served: Path, path: Path, version: int, error: Exception) -> NoReturn:
        """The load of `path` as `version` raised, the engine paused (`served`: the directory of the
        version it served before): roll back (roll_back) only
        after a definite failure, the load's caller still waiting. Otherwise the weights are no
        version's, and the server is broken (break_down):
        - the load timed out (may_still_run): the worker may be loading still, and any other call
          to it (a rollback) would take that load's answer for its own, and resume the engine
          while the worker reloads;
        - its caller got 504 already (self.overdue) and was told this server answers 503 until
          the reload ends: it ends in error."""
        if isinstance(error, HTTPException):
            detail = str(error.detail)
        else:
            detail = str(error) or type(error).__name__
        failed = f"loading {path} as version {version}"
        if may_still_run(error):
            await self.break_down(engine, f"{failed} timed out ({detail[:1000]}); the worker may still be "
                                          "loading: the weights are no version's; restart this server")
        if self.overdue is not None:
            await self.break_down(engine, f"the overdue reload of {path} as version {version} failed after "
                                          f"{time.monotonic() - self.overdue.since:.0f} s ({detail[:1000]}): the "
                                          "weights are no version's; restart this server")
        await self.roll_back(engine, served, path, version, error, f"{failed} failed ({detail[:1000]})")

    async def break_down(self, engine, why: str) -> NoReturn:
        """The engine's weights are no version's: /health, /generate and /update_weights answer
        503 saying `why` for good, the engine stays paused (switch_to) and the requests it held
        end as aborted (their tokens were all sampled before the pause). Aborts reach the engine
        core, never the workers."""
        gens = self.generations
        gens.broken = why
        log.error("%s", why)
        await engine.abort(list(gens.running))
        raise HTTPException(503, why)

    async def roll_back(self, engine, served: Path, path: Path, version: int, error: Exception,
                        failed: str) -> NoReturn:
        """The load of `path` as `version` failed for certain (the workers answered with an error),
        the engine paused. vLLM reloads layer by layer: the layers loaded before the failure hold
        the new weights, the others the old ones (worker_extension.py: _end_interrupted_reload).
        No version names that mix, so reload the version served before from its own directory
        (the trainer keeps the newest trainer.files.keep_weights versions, and "base" is the starting
        model), which the engine then serves exactly as before; the answer is the load's error.
        Should that fail too (its directory deleted, or it came by broadcast and holds no files,
        or it timed out), the server is broken (break_down)."""
        gens = self.generations
        status = error.status_code if isinstance(error, HTTPException) else 500
        start = time.perf_counter()
        try:
            if not any(served.glob("*.safetensors")):
                raise FileNotFoundError(f"{served} holds no *.safetensors")
            # A delta is rebuilt again from its base (DeltaFiles).
            await self.files.prepare(served, gens.version).load(engine, served, gens.version)
        except Exception as e:
            await self.break_down(engine, f"{failed}; rolling back to version {gens.version} from {served} "
                                          f"failed too ({str(e)[:1000] or type(e).__name__}): the weights are no "
                                          "version's; restart this server")
        log.warning("%s; rolled back to version %d from %s in %.3f s (%d requests held across it)", failed,
                    gens.version, served, time.perf_counter() - start, gens.held())
        raise HTTPException(status, f"{failed}; rolled back: this server still serves version {gens.version} "
                                    f"from {served}")
