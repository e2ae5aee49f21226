"""The server side of full weight delivery: /update_weights brings the engine to version v from
the directory the trainer delivered, reloading in place between two engine steps; /init_broadcaster
and /broadcaster set up the broadcast a version may arrive by instead of files.

An update pauses the engine ("wait": running requests finish first; "keep": they are frozen
between two decode steps), reloads, labels the engine's weights with the new version (vLLM's own
weight-version label, which the engine core attaches to every step's output: each token's version
comes back with its request, generation.py), resumes, and answers once the new weights serve. How
the workers get the tensors is a Reload, one implementation per kind (reload_kinds.py: files, a
delta rebuilt from a base in delta_reload.py, a broadcast); what a failed or overdue update leaves
is reload_failure.py's.

What can be refused (a delta, a version with a digest) is checked on every worker before any
worker loads it: all workers or none (all_workers.py staged, staging.py).

A server starts with FilesReload and switches to BroadcastReceive once its workers joined a
broadcast group (which is for the server's life). LoRA adapters arrive another way: adapters.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

from fastapi import HTTPException

from inference.access import WeightRoots
from inference.all_workers import Refused, every_worker
from inference.delta_reload import DeltaFiles
from inference.generation import Generations
from inference.reload_failure import Overdue, ReloadFailures
from inference.reload_kinds import BroadcastReceive, FilesReload, Reload, rpc_error
from rl.weights import broadcast as bc
from rl.config import RunConfig
from rl.inference_api import InitBroadcasterRequest, UpdateWeightsRequest

log = logging.getLogger("inference")


class ServedWeights:
    """The full weights the engine serves: the directory they came from, how the next version
    arrives (a Reload), and the routes that bring it in. The version itself is
    Generations.version: /generate reads it, an update writes it."""

    def __init__(self, cfg: RunConfig, roots: WeightRoots, generations: Generations):
        self.cfg = cfg
        self.roots = roots
        self.generations = generations
        self.engine = None
        self.path = str(cfg.model)
        self.lock = asyncio.Lock()
        # How a failed update rolls back, whatever the kind: from the served version's files.
        # With weight_sync.delta, the files may be a delta against a full version kept in memory.
        reloads = DeltaFiles if cfg.weight_sync.delta else FilesReload
        self.files = reloads(cfg.inference.timeouts.reload_s)
        # Files until the workers join a broadcast group (init_broadcaster).
        self.reload: Reload = self.files
        self.failures = ReloadFailures(generations, self.files)

    @property
    def workers(self) -> int:
        """Workers of this engine (tensor x pipeline parallel): each is one broadcast rank."""
        return self.engine.vllm_config.parallel_config.world_size

    async def update_weights(self, body: UpdateWeightsRequest) -> dict:
        path = self.roots.confine(body.path)
        reload = self.reload.prepare(path, body.version)
        self.failures.check_not_overdue()
        # Bounded here, not only by the engine: collective_rpc's own timeout is ignored by the
        # single-process executor (vLLM 0.32 UniProcExecutor, the default on one GPU; CPU runs a
        # worker process) and never covers an engine core that stopped answering, nor the pause.
        update = asyncio.create_task(self.update(reload, path, body))
        try:
            async with asyncio.timeout(reload.timeout_s):  # not wait_for: it can lose a cancel
                return await asyncio.shield(update)
        except TimeoutError:
            # The update goes on (a half-done reload cannot be called back); until it ends the
            # server says so on /health and takes no other update.
            self.failures.overdue = Overdue(path, body.version, time.monotonic() - reload.timeout_s,
                                            reload.timeout_s)
            update.add_done_callback(self.failures.finished_late)
            raise HTTPException(504, f"reload of {path} as version {body.version} still running after "
                                     f"{reload.timeout_s:g} s (inference.timeouts.reload_s); this server "
                                     "answers 503 until it ends") from None

    async def update(self, reload: Reload, path: Path, body: UpdateWeightsRequest) -> dict:
        async with self.lock:
            if reload.settled(path, body.version, self.generations.version):
                return {"version": self.generations.version, "reload_s": 0.0, "switched": 0}
            start = time.perf_counter()
            try:
                paused, switched = await self.switch_to(reload, path, body)
            except TimeoutError:
                # The pause or the prefix cache reset (a load's own timeout is switch_to's).
                raise HTTPException(504, f"reload of {path} as version {body.version} timed out") from None
            seconds = time.perf_counter() - paused
        log.info("now serving version %d from %s (mode %s: paused after %.3f s, reload %.3f s, "
                 "%d requests switched)", body.version, path, body.mode, paused - start,
                 seconds, switched)
        return {"version": self.generations.version, "reload_s": seconds, "switched": switched}

    async def switch_to(self, reload: Reload, path: Path, body: UpdateWeightsRequest) -> tuple[float, int]:
        """Pause, load, resume; returns when the pause took hold and how many requests switched."""
        gens = self.generations
        gens.serving.clear()
        try:
            # Logged before the pause goes out: what a stalled update waits on shows in the log.
            log.info("updating to version %d from %s: pausing the engine (mode %s)", body.version, path, body.mode)
            await self.pause(body.mode)
            # reload_s counts from here: the time nothing generates ("wait" drains first,
            # generating as it goes).
            paused = time.perf_counter()
            try:
                try:
                    await reload.load(self.engine, path, body.version)
                except Refused as e:
                    # Refused before any worker touched the engine: nothing to roll back.
                    log.warning("version %d from %s: %s; still serving version %d", body.version, path, e,
                                gens.version)
                    raise HTTPException(409, f"version {body.version} at {path}: {e}; this server still serves "
                                             f"version {gens.version}") from None
                except Exception as e:
                    await self.failures.load_failed(self.engine, Path(self.path), path, body.version, e)
                # The engine holds this version's weights now, whatever happens next.
                gens.version, self.path = body.version, str(path)
                # Before the resume: every step the engine core finishes from here on carries
                # this label, every step before it the old one (the pause waited for the steps in
                # flight, async scheduling's included), so each token's version is exact.
                await gens.label(body.version)
                switched = gens.switch()
                # Cached KV was computed by the old weights. This fails (vLLM logs it)
                # while running requests hold blocks, hence the per-reload cache salt.
                await self.engine.reset_prefix_cache()
                if self.engine.model_config.is_multimodal_model:
                    # The worker's reload clears its encoder outputs but not the scheduler's record
                    # of them: the next request with a seen image died ("Encoder cache miss").
                    await self.engine.reset_encoder_cache()
            finally:
                # A failed reload must not leave the engine paused, unless its weights are
                # no version's (vLLM's own routes would generate with them).
                if not gens.broken:
                    await self.engine.resume_generation()
        finally:
            gens.serving.set()
        return paused, switched

    async def pause(self, mode: str) -> None:
        """Stop the scheduler between two engine steps (mode: what happens to running requests).
        AsyncLLM.pause_generation does this and then sleeps a fixed 20 ms so that callers see the
        last outputs first (vllm 0.32: "not required for correctness"): a third of a tiny model's
        whole update (docs/performance.md), so the engine core is asked directly."""
        core = getattr(self.engine, "engine_core", None)
        if hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode=mode, clear_cache=False)
        else:
            await self.engine.pause_generation(mode=mode, clear_cache=False)

    async def broadcaster(self) -> dict:
        group = self.reload.group
        return {"workers": self.workers,
                "group": None if group is None else dict(zip(("address", "rank_offset", "world_size"), group))}

    async def init_broadcaster(self, body: InitBroadcasterRequest) -> dict:
        ws, timeout_s = self.cfg.weight_sync, self.cfg.timeouts.broadcast_s
        if self.cfg.weight_delivery != "broadcast":
            raise HTTPException(403, 'this server takes weights through files: its weight_sync.kind is not "broadcast"')
        # Like weight paths, only the configured source: the route makes every worker
        # connect to that address and load whatever arrives from it.
        if body.address != ws.address:
            raise HTTPException(403, f"address: {body.address} is not this server's weight_sync.address "
                                     f"({ws.address})")
        try:
            bc.parse_address(body.address)
        except ValueError as e:
            raise HTTPException(400, f"address: {e}") from None
        last = body.rank_offset + self.workers - 1
        if last >= body.world_size:
            raise HTTPException(400, f"world_size: {body.world_size} leaves no room for this server's "
                                     f"{self.workers} worker(s) from rank_offset {body.rank_offset}")
        wanted = (body.address, body.rank_offset, body.world_size)
        async with self.lock:
            # An overdue reload's answer would be taken for this call's (may_still_run).
            self.failures.check_not_overdue()
            if self.reload.group == wanted:
                # An orchestrator restarted on the same run asks again.
                return {"address": body.address, "ranks": list(range(body.rank_offset, last + 1)),
                        "world_size": body.world_size, "already": True}
            if self.reload.group is not None:
                raise HTTPException(409, f"already in the broadcast group {self.reload.group} (address, "
                                         "rank_offset, world_size); joining another needs a restart of this server")
            start = time.perf_counter()
            try:
                ranks = await every_worker(
                    self.engine, "asyncrl_init_broadcaster", timeout_s + 30,
                    (body.address, body.rank_offset, body.world_size, timeout_s,
                     f"{socket.gethostname()}:{self.cfg.inference.port}"))
            except Exception as e:
                raise rpc_error(f"joining the broadcast group at {body.address}", e) from None
            self.reload = BroadcastReceive(self.reload, wanted, timeout_s)
        log.info("joined the weight broadcast group at %s as rank(s) %s of %d in %.1f s", body.address, ranks,
                 body.world_size, time.perf_counter() - start)
        return {"address": body.address, "ranks": ranks, "world_size": body.world_size, "already": False}
