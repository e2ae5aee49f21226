"""LoRA adapters (trainer.lora.rank > 0): /load_lora_adapter loads a peft adapter from the run's
weights next to those serving, /unload_lora_adapter drops one, and a /generate naming it samples
with it on the base weights. Nothing pauses: with LoRA a version is an adapter, loaded once and
never changed (a new version is a new adapter).

vLLM's own runtime LoRA routes stay off (inference/server.py): they load adapters from any path.
Which of the two kinds serves is chosen once, from the config: Adapters.for_config.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from fastapi import HTTPException

from inference.access import WeightRoots
from rl.config import RunConfig
from rl.inference_api import LoadLoRARequest, UnloadLoRARequest

log = logging.getLogger("inference")


class Adapter:
    """A loaded LoRA adapter: the engine's LoRARequest, the policy version it is, and how many
    /generate calls use it right now (it cannot be unloaded under them)."""

    def __init__(self, request, version: int):
        self.request = request
        self.version = version
        self.running = 0

    @property
    def path(self) -> str:
        return self.request.lora_path


class Adapters:
    """The adapters this server serves (trainer.lora.rank > 0), by name."""

    def __init__(self, roots: WeightRoots, max_loras: int):
        self.roots = roots
        self.max_loras = max_loras
        self.engine = None
        self.loaded: dict[str, Adapter] = {}
        # Its own lock: adapter loads need not queue behind a full reload, nor the reverse.
        self.lock = asyncio.Lock()
        # Fresh per load, never reused: the engine identifies an adapter by this id, and a name
        # unloaded and loaded again from changed files must not be mistaken for the old one.
        self.last_lora_id = 0
        # Raises the HTTPException to answer while the workers must take no call (reload_failure.py
        # ReloadFailures.check_not_overdue: a reload overdue, or the server broken); set by routes.py.
        self.workers_free: Callable[[], None] = lambda: None

    @staticmethod
    def for_config(cfg: RunConfig, roots: WeightRoots) -> Adapters:
        """Adapters where the engine was started with LoRA (server.vllm_args), else AdaptersOff."""
        kind = Adapters if cfg.weight_delivery == "adapters" else AdaptersOff
        return kind(roots, cfg.inference.max_loras)

    def lookup(self, name: str | None) -> Adapter | None:
        """The adapter a /generate names; None: the base weights."""
        if name is None:
            return None
        adapter = self.loaded.get(name)
        if adapter is None:
            raise HTTPException(404, f"lora: adapter {name} is not loaded (POST /load_lora_adapter first)")
        return adapter

    def health(self) -> dict:
        """What /health adds."""
        return {"adapters": {name: a.version for name, a in self.loaded.items()}}

    async def load_lora_adapter(self, body: LoadLoRARequest) -> dict:
        path = self.roots.confine_adapter(body.path)
        async with self.lock:
            self.workers_free()
            loaded = self.loaded.get(body.name)
            if loaded is not None:
                if loaded.path == str(path) and loaded.version == body.version:
                    # An orchestrator retrying (or restarted) asks again.
                    return {"name": body.name, "version": body.version, "load_s": 0.0, "already": True}
                raise HTTPException(409, f"name: adapter {body.name} is already loaded as version "
                                         f"{loaded.version} from {loaded.path}; unload it first")
            if len(self.loaded) >= self.max_loras:
                # Refused rather than evicted: vLLM would drop its least recently used
                # adapter, and silently reload it from disk on its next request.
                raise HTTPException(409, f"name: {self.max_loras} adapters are loaded already "
                                         f"(inference.max_loras); unload one first")
            from vllm.lora.request import LoRARequest

            self.last_lora_id += 1
            lora = LoRARequest(body.name, self.last_lora_id, str(path))
            start = time.perf_counter()
            await self.add(lora, path)
            seconds = time.perf_counter() - start
            self.loaded[body.name] = Adapter(lora, body.version)
        log.info("loaded adapter %s (version %d, engine id %d) from %s in %.3f s", body.name, body.version,
                 lora.lora_int_id, path, seconds)
        return {"name": body.name, "version": body.version, "load_s": seconds, "already": False}

    async def add(self, lora, path) -> None:
        try:
            added = await self.engine.add_lora(lora)
        except Exception as e:
            if self.engine.errored:
                raise HTTPException(500, f"name: loading adapter {lora.lora_name} killed the engine: "
                                         f"{str(e)[:1000]}") from None
            # The files are there (checked above): the engine refused their contents
            # (rank above --max-lora-rank, modules it cannot adapt, bias, bad tensors).
            raise HTTPException(422, f"path: adapter {lora.lora_name} at {path} could not be loaded: "
                                     f"{str(e)[:1000]}") from None
        if not added:
            raise HTTPException(500, f"name: the engine did not add adapter {lora.lora_name} from {path}")

    async def unload_lora_adapter(self, body: UnloadLoRARequest) -> dict:
        async with self.lock:
            adapter = self.loaded.get(body.name)
            if adapter is None:
                raise HTTPException(404, f"name: adapter {body.name} is not loaded")
            if adapter.running:
                raise HTTPException(409, f"name: adapter {body.name} is in use by {adapter.running} "
                                         "running /generate call(s)")
            self.workers_free()
            # Forgotten before the engine call, with no suspension since the check: from here
            # a /generate naming it gets 404 instead of reaching the engine.
            del self.loaded[body.name]
            try:
                # False only when the engine had dropped it already: gone either way.
                await self.engine.remove_lora(adapter.request.lora_int_id)
            except Exception as e:
                raise HTTPException(500, f"name: unloading adapter {body.name} failed: {str(e)[:1000]}") from None
        log.info("unloaded adapter %s (version %d)", body.name, adapter.version)
        return {"name": body.name, "version": adapter.version}


class AdaptersOff(Adapters):
    """trainer.lora.rank = 0: the engine was started without LoRA, so none can be loaded (and
    none can be named by /generate or /unload_lora_adapter: they are not loaded)."""

    def health(self) -> dict:
        return {}  # without LoRA the answer stays as it was

    async def load_lora_adapter(self, body: LoadLoRARequest) -> dict:
        raise HTTPException(400, "LoRA serving is off on this server (trainer.lora.rank = 0); "
                                 "start it with trainer.lora.rank > 0")
