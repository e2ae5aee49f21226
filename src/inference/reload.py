"""The server side of full weight delivery: /update_weights brings the engine to version v from
the directory the trainer delivered, reloading in place between two engine steps; /init_broadcaster
and /broadcaster set up the broadcast a version may arrive by instead of files.

An update pauses the engine ("wait": running requests finish first; "keep": they are frozen
between two decode steps), reloads, labels the engine's weights with the new version (vLLM's own
weight-version label, which the engine core attaches to every step's output: each token's version
comes back with its request, generation.py), resumes, and answers once the new weights serve. How the workers get the
tensors is a Reload, one implementation per kind:

  FilesReload       the workers read the directory's safetensors
  DeltaFiles        FilesReload with weight_sync.delta: the workers keep each full version as a
                    base in host memory; a directory holding delta.json (ApplyDelta) is rebuilt
                    from it (rl/weights/delta.py), or refused before the engine is touched
  BroadcastReceive  the directory holds broadcast.json: the workers receive the tensors (or a
                    delta's changed values) from the trainer's broadcast (rl/weights/broadcast.py); any
                    other directory is files

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
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from fastapi import HTTPException

from inference.access import WeightRoots
from inference.all_workers import Refused, every_worker, may_still_run, staged, timed_out
from inference.generation import Generations
from rl.weights import broadcast as bc
from rl.weights import delta as wd
from rl.config import RunConfig
from rl.inference_api import InitBroadcasterRequest, UpdateWeightsRequest
from rl.rundir import STABLE

log = logging.getLogger("inference")


def rpc_error(what: str, e: Exception) -> HTTPException:
    text = str(e) or type(e).__name__
    return HTTPException(504 if timed_out(e) else 500, f"{what} failed: {text[:1000]}")


class Reload(ABC):
    """How the workers load version v from a directory the trainer delivered."""

    timeout_s: float
    """Longest an update by this reload may take, waiting for the update lock and the pause
    included, before /update_weights answers 504."""

    group: tuple[str, int, int] | None = None
    """(address, rank_offset, world_size) of the broadcast group the workers joined, if any."""

    @abstractmethod
    def prepare(self, path: Path, version: int) -> Reload:
        """The reload that loads `path` as `version`, or the HTTPException saying why none can.
        Runs before the update lock: a refusal waits behind no reload."""

    def settled(self, path: Path, version: int, serving: int) -> bool:
        """Under the update lock, the engine serving `serving`: True if `version` needs no reload."""
        return False

    @abstractmethod
    async def load(self, engine, path: Path, version: int) -> None:
        """With the engine paused: load the weights (worker_extension.py)."""


class FilesReload(Reload):
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def prepare(self, path: Path, version: int) -> Reload:
        if (path / bc.MANIFEST).is_file():
            raise HTTPException(409, f"path: {path} holds a broadcast manifest, but this server is in no "
                                     "broadcast group (POST /init_broadcaster first)")
        if (path / wd.MANIFEST).is_file():
            raise HTTPException(409, f"path: {path} holds a weight delta, but this server's weight_sync.delta "
                                     "is false (it keeps no base to rebuild it from)")
        return self

    async def load(self, engine, path: Path, version: int) -> None:
        await every_worker(engine, "asyncrl_reload_weights", self.timeout_s, (str(path),))


class DeltaFiles(FilesReload):
    """FilesReload with weight_sync.delta: a full version is kept in the workers' host memory as
    the base of later deltas (staging.py full_files), a directory holding
    delta.json is rebuilt from that base (ApplyDelta). `held` is the base the workers hold."""

    def __init__(self, timeout_s: float):
        super().__init__(timeout_s)
        self.held: wd.Digest | None = None

    def prepare(self, path: Path, version: int) -> Reload:
        if not (path / wd.MANIFEST).is_file():
            return super().prepare(path, version)
        try:
            manifest = wd.read_manifest(path)
        except (OSError, ValueError) as e:
            raise HTTPException(422, f"path: {path}/{wd.MANIFEST} is malformed: {e}") from None
        if manifest.version != version:
            raise HTTPException(400, f"version: {version}, but {path}/{wd.MANIFEST} is version {manifest.version}")
        if self.held != manifest.base:
            check_base(path, manifest)
        return ApplyDelta(self)

    async def load(self, engine, path: Path, version: int) -> None:
        held = (await staged(engine, "asyncrl_stage_full", self.timeout_s, str(path)))[0]["base"]
        self.held = None if held is None else wd.Digest(*held)


class ApplyDelta(Reload):
    """One delta: the workers rebuild the version from their base and load it."""

    def __init__(self, files: DeltaFiles):
        self.files, self.timeout_s = files, files.timeout_s

    def prepare(self, path: Path, version: int) -> Reload:
        return self.files.prepare(path, version)

    async def load(self, engine, path: Path, version: int) -> None:
        out = await staged(engine, "asyncrl_stage_delta", self.timeout_s, str(path))
        self.files.held = wd.Digest(*out[0]["base"])


def check_base(path: Path, manifest: wd.Manifest) -> None:
    """Before the update lock: 409 when the delta's base is not there to be read, or is not the
    one it names (another run's, or another version written under that number). Damage inside
    the base's files shows only when the worker reads them (it checks their checksum)."""
    base = wd.base_dir(path, manifest)
    refused = f"version {manifest.version} at {path}: {wd.REFUSED}:"
    if not (base / STABLE).is_file():
        raise HTTPException(409, f"{refused} its base, version {manifest.base_version}, is missing ({base}); a "
                                 "server catches up through the last full version, which trainer.keep_weights keeps")
    try:
        digest = wd.Digest.read(base)
    except (OSError, ValueError) as e:
        raise HTTPException(409, f"{refused} its base {base} has no readable {wd.DIGEST} ({e})") from None
    if digest.run_id != manifest.run_id:
        raise HTTPException(409, f"{refused} it belongs to run {manifest.run_id}, its base {base} to run "
                                 f"{digest.run_id}")
    if digest != manifest.base:
        raise HTTPException(409, f"{refused} it is against version {manifest.base_version} with checksum "
                                 f"{manifest.base_checksum}, {base} holds version {digest.version} with checksum "
                                 f"{digest.checksum}")


class BroadcastReceive(Reload):
    def __init__(self, files: FilesReload, group: tuple[str, int, int], sync_timeout_s: float):
        self.files = files
        self.group = group
        # The workers' own waits are bounded by weight_sync.timeout_s and name the group; this
        # one only catches a worker that never answers.
        self.timeout_s = files.timeout_s + sync_timeout_s

    def prepare(self, path: Path, version: int) -> Reload:
        if not (path / bc.MANIFEST).is_file():
            return self.files.prepare(path, version)
        try:
            manifest = bc.read_manifest(path)
        except (ValueError, KeyError, TypeError) as e:
            raise HTTPException(422, f"path: {path}/{bc.MANIFEST} is malformed: {e}") from None
        if manifest.version != version:
            raise HTTPException(400, f"version: {version}, but {path}/{bc.MANIFEST} is version {manifest.version}")
        return self

    def settled(self, path: Path, version: int, serving: int) -> bool:
        if serving == version:
            # Already received (another caller asked first): receiving again would wait for a
            # broadcast that never comes.
            return True
        if (path / bc.DELIVERED).exists():
            raise HTTPException(409, f"version {version} was broadcast without this server (it serves "
                                     f"{serving}); it cannot catch up without a restart of the trainer and the "
                                     "servers")
        return False

    async def load(self, engine, path: Path, version: int) -> None:
        try:
            await staged(engine, "asyncrl_stage_broadcast", self.timeout_s, str(path / bc.MANIFEST))
        except Refused:
            raise
        except Exception as e:
            raise rpc_error(f"receiving version {version} by broadcast", e) from None


@dataclass(frozen=True)
class Overdue:
    """An update still running after its timeout (its caller got 504)."""

    path: Path
    version: int
    since: float
    """time.monotonic() when the update started."""
    timeout_s: float


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
        self.files = reloads(cfg.inference.reload_timeout_s)
        # Files until the workers join a broadcast group (init_broadcaster).
        self.reload: Reload = self.files
        self.overdue: Overdue | None = None

    @property
    def workers(self) -> int:
        """Workers of this engine (tensor x pipeline parallel): each is one broadcast rank."""
        return self.engine.vllm_config.parallel_config.world_size

    async def update_weights(self, body: UpdateWeightsRequest) -> dict:
        path = self.roots.confine(body.path)
        reload = self.reload.prepare(path, body.version)
        self.check_not_overdue()
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
            self.overdue = Overdue(path, body.version, time.monotonic() - reload.timeout_s, reload.timeout_s)
            update.add_done_callback(self.finished_late)
            raise HTTPException(504, f"reload of {path} as version {body.version} still running after "
                                     f"{reload.timeout_s:g} s (inference.reload_timeout_s); this server "
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

    def check_not_overdue(self) -> None:
        """503 while an update that outlived its timeout still runs (the weights are mid-load), and
        for good once the weights are no version's (Generations.broken)."""
        if self.generations.broken:
            raise HTTPException(503, self.generations.broken)
        o = self.overdue
        if o is not None:
            raise HTTPException(503, f"reload of {o.path} as version {o.version} still running after "
                                     f"{time.monotonic() - o.since:.0f} s (inference.reload_timeout_s = "
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
                    await self.load_failed(path, body.version, e)
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

    async def load_failed(self, path: Path, version: int, error: Exception) -> NoReturn:
        """The load of `path` as `version` raised, the engine paused: roll back (roll_back) only
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
            await self.break_down(f"{failed} timed out ({detail[:1000]}); the worker may still be loading: the "
                                  "weights are no version's; restart this server")
        if self.overdue is not None:
            await self.break_down(f"the overdue reload of {path} as version {version} failed after "
                                  f"{time.monotonic() - self.overdue.since:.0f} s ({detail[:1000]}): the weights "
                                  "are no version's; restart this server")
        await self.roll_back(path, version, error, f"{failed} failed ({detail[:1000]})")

    async def break_down(self, why: str) -> NoReturn:
        """The engine's weights are no version's: /health, /generate and /update_weights answer
        503 saying `why` for good, the engine stays paused (switch_to) and the requests it held
        end as aborted (their tokens were all sampled before the pause). Aborts reach the engine
        core, never the workers."""
        gens = self.generations
        gens.broken = why
        log.error("%s", why)
        await self.engine.abort(list(gens.running))
        raise HTTPException(503, why)

    async def roll_back(self, path: Path, version: int, error: Exception, failed: str) -> NoReturn:
        """The load of `path` as `version` failed for certain (the workers answered with an error),
        the engine paused. vLLM reloads layer by layer: the layers loaded before the failure hold
        the new weights, the others the old ones (worker_extension.py: _end_interrupted_reload).
        No version names that mix, so reload the version served before from its own directory
        (the trainer keeps the newest trainer.keep_weights versions, and "base" is the starting
        model), which the engine then serves exactly as before; the answer is the load's error.
        Should that fail too (its directory deleted, or it came by broadcast and holds no files,
        or it timed out), the server is broken (break_down)."""
        gens = self.generations
        status = error.status_code if isinstance(error, HTTPException) else 500
        served = Path(self.path)
        start = time.perf_counter()
        try:
            if not any(served.glob("*.safetensors")):
                raise FileNotFoundError(f"{served} holds no *.safetensors")
            # A delta is rebuilt again from its base (DeltaFiles).
            await self.files.prepare(served, gens.version).load(self.engine, served, gens.version)
        except Exception as e:
            await self.break_down(f"{failed}; rolling back to version {gens.version} from {served} failed too "
                                  f"({str(e)[:1000] or type(e).__name__}): the weights are no version's; restart "
                                  "this server")
        log.warning("%s; rolled back to version %d from %s in %.3f s (%d requests held across it)", failed,
                    gens.version, served, time.perf_counter() - start, gens.held())
        raise HTTPException(status, f"{failed}; rolled back: this server still serves version {gens.version} "
                                    f"from {served}")

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
        ws = self.cfg.weight_sync
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
            self.check_not_overdue()
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
                    self.engine, "asyncrl_init_broadcaster", ws.timeout_s + 30,
                    (body.address, body.rank_offset, body.world_size, ws.timeout_s,
                     f"{socket.gethostname()}:{self.cfg.inference.port}"))
            except Exception as e:
                raise rpc_error(f"joining the broadcast group at {body.address}", e) from None
            self.reload = BroadcastReceive(self.reload, wanted, ws.timeout_s)
        log.info("joined the weight broadcast group at %s as rank(s) %s of %d in %.1f s", body.address, ranks,
                 body.world_size, time.perf_counter() - start)
        return {"address": body.address, "ranks": ranks, "world_size": body.world_size, "already": False}
