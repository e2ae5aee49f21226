"""`rl inference @ cfg.toml`: vLLM's OpenAI-compatible server with asyncrl's own routes.

    rl inference @ configs/demo.toml

This is the one module that touches vLLM's server internals (pinned: vllm 0.32). It builds the
app exactly as `vllm serve` does, then puts the project's routes (the contract in
rl/inference_api.py) in front:

  POST /generate         token ids in, token ids + logprobs + per-token policy versions out,
                         straight on the engine (AsyncLLM.generate), not through the OpenAI layer
  POST /abort            abort the engine requests of those /generate calls
  POST /update_weights   {"path", "version", "mode"}: pause the engine ("wait": running requests
                         finish first; "keep": they are frozen between two decode steps), reload
                         in place, resume; answers once the new weights serve. Paths (here
                         and in /load_lora_adapter) are relative to this server's output_dir,
                         "base" (the model it started with), or absolute within the roots
  POST /init_broadcaster {"address", "rank_offset", "world_size"}: every worker joins the
                         trainer's weight broadcast group (rl/broadcast.py); after that an
                         /update_weights whose directory holds broadcast.json receives the
                         tensors from the trainer instead of reading files
  GET  /broadcaster      {"workers", "group"}: how many ranks the server takes in a broadcast
                         group (its workers), and the group it joined, if any
  POST /load_lora_adapter   {"name", "path", "version"} (trainer.lora.rank > 0): load a peft
                         adapter from the run's weights; /generate {"lora": name} samples with it
  POST /unload_lora_adapter {"name"}: drop it (409 while a /generate uses it)
  GET  /health           engine health, the version now serving, engine requests running and,
                         with LoRA, the adapters loaded and their versions

Per-token versions: each engine request keeps switch points (token index, version); an update
reads from the workers how many tokens each in-flight request had sampled before the reload and
appends (that count, new version). Requests still queued in the engine keep their older tag
(see AdminRoutes.switch). Adapter requests have no switch points: every token carries the
version the adapter was loaded as (an adapter never changes once loaded; a new version is a new
adapter).

vLLM's dev-mode routes (/collective_rpc and friends) and its runtime LoRA routes stay off: they
would let any client run methods on the workers, or load adapters from any path.

With a token (inference.api_token, else $ASYNCRL_API_TOKEN) every route needs it but PUBLIC
(liveness and monitoring probes): ours, vLLM's /v1 (also given to vLLM as --api-key), and what
--api-key leaves open (/invocations and /generative_scoring generate, /scale_elastic_ep
reconfigures the engine). Without a token the server refuses to bind anything but loopback.
Request bodies that do not validate get 400 with one line naming each offending field.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse

from inference import orphans
from rl import broadcast as bc
from rl.config import RunConfig
from rl.inference_api import (
    AbortRequest,
    GeneratedSample,
    GenerateRequest,
    GenerateResponse,
    InitBroadcasterRequest,
    LoadLoRARequest,
    UnloadLoRARequest,
    UpdateWeightsRequest,
    resolve_token,
)
from rl.heartbeat import set_phase
from rl.rundir import RunDir

log = logging.getLogger("inference")
SHUTDOWN_GRACE_S = 5  # requests still running at shutdown get this long, then are cancelled
READY_POLL_S = 0.1  # how often a starting server asks its own /health whether it is up

EXTENSION = "inference.worker_extension.WeightReloadExtension"
FINISH_REASONS = ("stop", "length", "abort")
# vLLM accepts only these --max-lora-rank values (vllm/config/lora.py MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# Read-only probes a load balancer or Prometheus polls without credentials; nothing here runs
# the engine or reveals more than the version served.
PUBLIC = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})
UNAUTHORIZED = "missing or wrong bearer token (inference.api_token or ASYNCRL_API_TOKEN)"


def authorized(headers: Headers, token: str) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    # Bytes: compare_digest refuses non-ASCII str, and a client controls this header.
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


class TokenGuard:
    """ASGI middleware: every request but OPTIONS (CORS preflight) and PUBLIC paths needs the
    token. Outside the routers, so it covers vLLM's routes too and turns requests away before
    their bodies are read."""

    def __init__(self, app, token: str):
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in PUBLIC or authorized(Headers(scope=scope), self.token):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": UNAUTHORIZED})
        # vLLM's error shape, as its exception handlers give our HTTPExceptions.
        response = JSONResponse({"error": {"message": UNAUTHORIZED, "type": "Unauthorized", "code": 401}},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one line naming each field: "body.n: Input should be greater than or
    equal to 1 (got 0)" (vLLM's own handler writes one dict per line, inputs included)."""
    parts = []
    for e in errors[:3]:
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "json_invalid":
            parts.append(f"body: not valid JSON ({e['ctx']['error']} at character {e['loc'][-1]})")
            continue
        text = f"{loc}: {e['msg']}"
        got = e.get("input")
        if e["type"] != "missing" and isinstance(got, (bool, int, float, str)):
            got = repr(got)
            text += f" (got {got[:60]}{'...' if len(got) > 60 else ''})"
        parts.append(text)
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    # A field name is the client's own text (an unknown key), newlines included.
    return " ".join("; ".join(parts).split())


class OneLineErrors(APIRoute):
    """Our routes: a body that does not validate is a 400 whose one-line message names the
    field, raised as an HTTPException so vLLM's handler renders it like our other errors."""

    def get_route_handler(self) -> Callable:
        handle = super().get_route_handler()

        async def handle_one_line(request: Request):
            try:
                return await handle(request)
            except RequestValidationError as e:
                raise HTTPException(400, validation_message(e.errors())) from None

        return handle_one_line


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


class Generation:
    """One /generate call: the engine requests "<request_id>-<i>" of its n samples."""

    def __init__(self, request_id: str, n: int):
        self.engine_ids = [f"{request_id}-{i}" for i in range(n)]
        self.aborted = False


class AdminRoutes:
    """The project's routes and the state they share: the version now serving, the /generate
    calls in progress and the version switch points of their engine requests."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.version = 0
        self.path = str(cfg.model)
        # Weights load only from the run's weights/ and the starting model's directory.
        self.roots = [RunDir(cfg.output_dir).weights.resolve(), Path(cfg.model).resolve()]
        self.token = resolve_token(cfg.inference.api_token)
        self.lock = asyncio.Lock()
        # Cleared during an update: /generate calls wait on it before reading the version, so a
        # request registered at version v samples its first token with v's weights.
        self.serving = asyncio.Event()
        self.serving.set()
        self.reloads = 0
        self.generations: dict[str, Generation] = {}
        # Engine request id -> [(first token index, version that samples from there on), ...].
        self.switches: dict[str, list[tuple[int, int]]] = {}
        self.engine = None
        # (address, rank_offset, world_size) once the workers joined a broadcast group.
        self.group: tuple[str, int, int] | None = None
        self.adapters: dict[str, Adapter] = {}
        # Its own lock: adapter loads need not queue behind a full reload, nor the reverse.
        self.adapter_lock = asyncio.Lock()
        # Fresh per load, never reused: the engine identifies an adapter by this id, and a name
        # unloaded and loaded again from changed files must not be mistaken for the old one.
        self.last_lora_id = 0
        output_dir = Path(cfg.output_dir)
        self.adapter_root = RunDir(output_dir).weights.resolve()
        self.runs_root = (output_dir / "runs").resolve()

    def local(self, path: str) -> Path:
        """A path as the orchestrator sends it: relative to the run directory (every host mounts
        it where it likes), "base" for the model this server started with, or absolute."""
        if path == "base":
            return Path(self.cfg.model)
        p = Path(path)
        return p if p.is_absolute() else Path(self.cfg.output_dir) / p

    def confine(self, path: str) -> Path:
        resolved = self.local(path).resolve()
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise HTTPException(403, f"path: {path} is outside the allowed weight roots")
        if not resolved.is_dir():
            raise HTTPException(404, f"path: {path} is not a directory")
        if not any(resolved.glob("*.safetensors")) and not (resolved / bc.MANIFEST).is_file():
            raise HTTPException(422, f"path: {path} holds no *.safetensors and no {bc.MANIFEST}")
        return resolved

    def confine_adapter(self, path: str) -> Path:
        # Adapters load only from this run's weights/ or a multi-run's runs/<name>/weights/.
        resolved = self.local(path).resolve()
        inside = resolved.is_relative_to(self.adapter_root)
        if not inside and resolved.is_relative_to(self.runs_root):
            parts = resolved.relative_to(self.runs_root).parts
            inside = len(parts) >= 2 and parts[1] == "weights"
        if not inside:
            raise HTTPException(403, f"path: {path} is outside {self.adapter_root} and "
                                     f"{self.runs_root}/<run>/weights")
        if not resolved.is_dir():
            raise HTTPException(404, f"path: {path} is not a directory")
        for name in ADAPTER_FILES:
            if not (resolved / name).is_file():
                raise HTTPException(422, f"path: {path} holds no {name} (not a peft adapter)")
        return resolved

    def adapter(self, name: str | None) -> Adapter | None:
        if name is None:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise HTTPException(404, f"lora: adapter {name} is not loaded (POST /load_lora_adapter first)")
        return adapter

    @property
    def workers(self) -> int:
        """Workers of this engine (tensor x pipeline parallel): each is one broadcast rank."""
        return self.engine.vllm_config.parallel_config.world_size

    def broadcast_manifest(self, path: Path, version: int) -> bc.Manifest:
        if self.group is None:
            raise HTTPException(409, f"path: {path} holds a broadcast manifest, but this server is in no "
                                     "broadcast group (POST /init_broadcaster first)")
        try:
            manifest = bc.read_manifest(path)
        except (ValueError, KeyError, TypeError) as e:
            raise HTTPException(422, f"path: {path}/{bc.MANIFEST} is malformed: {e}") from None
        if manifest.version != version:
            raise HTTPException(400, f"version: {version}, but {path}/{bc.MANIFEST} is version {manifest.version}")
        return manifest

    def check_generate(self, body: GenerateRequest) -> None:
        # Checked here, not left to the engine: its errors name neither the field nor seq_len.
        prompt_len, limit = len(body.prompt_token_ids), self.cfg.seq_len
        if prompt_len + body.max_tokens > limit:
            raise HTTPException(400, f"max_tokens: prompt ({prompt_len} tokens) + max_tokens "
                                     f"({body.max_tokens}) exceeds seq_len {limit}")
        vocab = self.engine.model_config.get_vocab_size()
        for field in ("prompt_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(body, field) if not 0 <= t < vocab]
            if bad:
                raise HTTPException(400, f"{field}: token ids {bad[:5]} outside the vocabulary "
                                         f"[0, {vocab})")

    async def sample(self, gen: Generation, i: int, body: GenerateRequest, prompt, version: int,
                     adapter: Adapter | None = None) -> tuple[GeneratedSample, list[float | None] | None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine_id = gen.engine_ids[i]
        # Checked right before engine.generate, which registers the request before its first
        # suspension: an /abort that ran earlier is seen here, a later one reaches the engine.
        if gen.aborted:
            return GeneratedSample(token_ids=[], logprobs=[], versions=[],
                                   finish_reason="abort"), None
        params = SamplingParams(
            n=1, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            max_tokens=body.max_tokens, stop=body.stop or None, stop_token_ids=body.stop_token_ids, logprobs=0,
            # One sample scores the prompt: the samples share it, and asking on all n would
            # compute it n times instead of sharing the prefix cache.
            prompt_logprobs=0 if body.prompt_logprobs and i == 0 else None,
            # Stop strings are matched on text: only they need the detokenizer.
            output_kind=RequestOutputKind.FINAL_ONLY, detokenize=bool(body.stop),
        )
        # An adapter request is registered without switch points (None): a full reload does not
        # change what version its tokens are, and switch() leaves it alone.
        switches = [(0, version)]
        self.switches[engine_id] = None if adapter else switches
        try:
            async for out in self.engine.generate(prompt, params, engine_id,
                                                  lora_request=adapter.request if adapter else None):
                final = out
        finally:
            del self.switches[engine_id]
        c = final.outputs[0]
        if c.finish_reason not in FINISH_REASONS:
            raise HTTPException(500, f"engine request {engine_id} finished with {c.finish_reason}")
        tokens = list(c.token_ids)
        versions = [version] * len(tokens)
        for start, v in switches[1:]:
            versions[start:] = [v] * max(0, len(tokens) - start)
        sample = GeneratedSample(
            token_ids=tokens, logprobs=[c.logprobs[j][t].logprob for j, t in enumerate(tokens)],
            versions=versions, finish_reason=c.finish_reason,
        )
        prompt_logprobs = None
        if params.prompt_logprobs is not None and final.prompt_logprobs is not None:
            prompt_logprobs = [None if d is None else d[t].logprob
                               for d, t in zip(final.prompt_logprobs, body.prompt_token_ids)]
        return sample, prompt_logprobs

    def router(self) -> APIRouter:
        from vllm.inputs.engine import tokens_input

        router = APIRouter(route_class=OneLineErrors)

        @router.get("/health")
        async def health() -> dict:
            await self.engine.check_health()
            answer = {"status": "ok", "version": self.version, "path": self.path,
                      "running": len(self.switches)}
            # Only where adapters can be served: without LoRA the answer stays as it was.
            if self.cfg.trainer.lora.rank > 0:
                answer["adapters"] = {name: a.version for name, a in self.adapters.items()}
            return answer

        @router.get("/broadcaster")
        async def broadcaster() -> dict:
            group = None if self.group is None else dict(zip(("address", "rank_offset", "world_size"), self.group))
            return {"workers": self.workers, "group": group}

        @router.post("/generate")
        async def generate(body: GenerateRequest) -> GenerateResponse:
            self.check_generate(body)
            adapter = self.adapter(body.lora)
            if body.request_id in self.generations:
                raise HTTPException(409, f"request_id: {body.request_id} is already generating")
            gen = self.generations[body.request_id] = Generation(body.request_id, body.n)
            # Counted from here, before any suspension: an unload that runs later sees it.
            if adapter:
                adapter.running += 1
            try:
                await self.serving.wait()
                # Salted per reload: the prefix cache cannot always be reset (an in-flight
                # update keeps running requests' blocks), and KV computed by older weights must
                # not seed a request tagged with the new version. Adapter requests also per
                # load: vLLM keys cached blocks by adapter name and path, which a reload of
                # rewritten files under the same name keeps. Rendered input (not a raw
                # TokensPrompt) keeps vLLM off its tokenizer thread pool.
                salt = f"reload-{self.reloads}"
                if adapter:
                    salt += f"-lora-{adapter.request.lora_int_id}"
                prompt = tokens_input(body.prompt_token_ids, cache_salt=salt)
                version = adapter.version if adapter else self.version
                # A TaskGroup: if one sample fails, the others are cancelled, which aborts
                # their engine requests instead of leaving them running for nobody.
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self.sample(gen, i, body, prompt, version, adapter))
                             for i in range(body.n)]
            except* Exception as failed:
                raise failed.exceptions[0] from None  # what the exception handlers understand
            finally:
                del self.generations[body.request_id]
                if adapter:
                    adapter.running -= 1
            results = [t.result() for t in tasks]
            return GenerateResponse(samples=[s for s, _ in results],
                                    prompt_logprobs=results[0][1] if body.prompt_logprobs else None)

        @router.post("/abort")
        async def abort(body: AbortRequest) -> dict:
            gens = [self.generations[r] for r in set(body.request_ids) if r in self.generations]
            for gen in gens:
                gen.aborted = True
            if gens:
                # External ids: vLLM aborts every internal request made from each.
                await self.engine.abort([e for gen in gens for e in gen.engine_ids])
            return {"aborted": len(gens)}

        @router.post("/init_broadcaster")
        async def init_broadcaster(body: InitBroadcasterRequest) -> dict:
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
                if self.group == wanted:
                    # An orchestrator restarted on the same run asks again.
                    return {"address": body.address, "ranks": list(range(body.rank_offset, last + 1)),
                            "world_size": body.world_size, "already": True}
                if self.group is not None:
                    raise HTTPException(409, f"already in the broadcast group {self.group} (address, rank_offset, "
                                             "world_size); joining another needs a restart of this server")
                start = time.perf_counter()
                try:
                    ranks = await self.engine.collective_rpc(
                        "asyncrl_init_broadcaster", timeout=ws.timeout_s + 30,
                        args=(body.address, body.rank_offset, body.world_size, ws.timeout_s,
                              f"{socket.gethostname()}:{self.cfg.inference.port}"))
                except Exception as e:
                    raise self.rpc_error(f"joining the broadcast group at {body.address}", e) from None
                self.group = wanted
            log.info("joined the weight broadcast group at %s as rank(s) %s of %d in %.1f s", body.address, ranks,
                     body.world_size, time.perf_counter() - start)
            return {"address": body.address, "ranks": ranks, "world_size": body.world_size, "already": False}

        @router.post("/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRARequest) -> dict:
            if self.cfg.trainer.lora.rank == 0:
                raise HTTPException(400, "LoRA serving is off on this server (trainer.lora.rank = 0); "
                                         "start it with trainer.lora.rank > 0")
            path = self.confine_adapter(body.path)
            async with self.adapter_lock:
                loaded = self.adapters.get(body.name)
                if loaded is not None:
                    if loaded.path == str(path) and loaded.version == body.version:
                        # An orchestrator retrying (or restarted) asks again.
                        return {"name": body.name, "version": body.version, "load_s": 0.0, "already": True}
                    raise HTTPException(409, f"name: adapter {body.name} is already loaded as version "
                                             f"{loaded.version} from {loaded.path}; unload it first")
                limit = self.cfg.inference.max_loras
                if len(self.adapters) >= limit:
                    # Refused rather than evicted: vLLM would drop its least recently used
                    # adapter, and silently reload it from disk on its next request.
                    raise HTTPException(409, f"name: {limit} adapters are loaded already "
                                             f"(inference.max_loras); unload one first")
                from vllm.lora.request import LoRARequest

                self.last_lora_id += 1
                lora = LoRARequest(body.name, self.last_lora_id, str(path))
                start = time.perf_counter()
                try:
                    added = await self.engine.add_lora(lora)
                except Exception as e:
                    if self.engine.errored:
                        raise HTTPException(500, f"name: loading adapter {body.name} killed the engine: "
                                                 f"{str(e)[:1000]}") from None
                    # The files are there (checked above): the engine refused their contents
                    # (rank above --max-lora-rank, modules it cannot adapt, bias, bad tensors).
                    raise HTTPException(422, f"path: adapter {body.name} at {path} could not be loaded: "
                                             f"{str(e)[:1000]}") from None
                if not added:
                    raise HTTPException(500, f"name: the engine did not add adapter {body.name} from {path}")
                seconds = time.perf_counter() - start
                self.adapters[body.name] = Adapter(lora, body.version)
            log.info("loaded adapter %s (version %d, engine id %d) from %s in %.3f s", body.name, body.version,
                     lora.lora_int_id, path, seconds)
            return {"name": body.name, "version": body.version, "load_s": seconds, "already": False}

        @router.post("/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRARequest) -> dict:
            async with self.adapter_lock:
                adapter = self.adapters.get(body.name)
                if adapter is None:
                    raise HTTPException(404, f"name: adapter {body.name} is not loaded")
                if adapter.running:
                    raise HTTPException(409, f"name: adapter {body.name} is in use by {adapter.running} "
                                             "running /generate call(s)")
                # Forgotten before the engine call, with no suspension since the check: from here
                # a /generate naming it gets 404 instead of reaching the engine.
                del self.adapters[body.name]
                try:
                    # False only when the engine had dropped it already: gone either way.
                    await self.engine.remove_lora(adapter.request.lora_int_id)
                except Exception as e:
                    raise HTTPException(500, f"name: unloading adapter {body.name} failed: {str(e)[:1000]}") from None
            log.info("unloaded adapter %s (version %d)", body.name, adapter.version)
            return {"name": body.name, "version": adapter.version}

        @router.post("/update_weights")
        async def update_weights(body: UpdateWeightsRequest) -> dict:
            path = self.confine(body.path)
            manifest = None
            if (path / bc.MANIFEST).is_file():
                manifest = self.broadcast_manifest(path, body.version)
            async with self.lock:
                if manifest is not None:
                    if self.version == body.version:
                        # Already received (another caller asked first): receiving again would
                        # wait for a broadcast that never comes.
                        return {"version": self.version, "reload_s": 0.0, "switched": 0}
                    if (path / bc.DELIVERED).exists():
                        raise HTTPException(409, f"version {body.version} was broadcast without this server "
                                                 f"(it serves {self.version}); it cannot catch up without a "
                                                 "restart of the trainer and the servers")
                    method, arg = "asyncrl_receive_weights", str(path / bc.MANIFEST)
                    # The workers' own waits are bounded by weight_sync.timeout_s and name the
                    # group; this one only catches a worker that never answers.
                    rpc_timeout = self.cfg.inference.reload_timeout_s + self.cfg.weight_sync.timeout_s
                else:
                    method, arg, rpc_timeout = "asyncrl_reload_weights", str(path), self.cfg.inference.reload_timeout_s
                self.serving.clear()
                start = time.perf_counter()
                try:
                    await self.pause(body.mode)
                    # reload_s counts from here: the time nothing generates ("wait" drains first,
                    # generating as it goes).
                    paused = time.perf_counter()
                    try:
                        try:
                            sampled = await self.engine.collective_rpc(method, timeout=rpc_timeout, args=(arg,))
                        except Exception as e:
                            if manifest is None:
                                raise
                            raise self.rpc_error(f"receiving version {body.version} by broadcast", e) from None
                        switched = self.switch(sampled[0], body.version)
                        self.reloads += 1
                        # Cached KV was computed by the old weights. This fails (vLLM logs it)
                        # while running requests hold blocks, hence the per-reload cache salt.
                        await self.engine.reset_prefix_cache()
                        self.version, self.path = body.version, str(path)
                    finally:
                        # A failed reload must not leave the engine paused.
                        await self.engine.resume_generation()
                except TimeoutError:
                    raise HTTPException(504, f"reload of {path} timed out") from None
                finally:
                    self.serving.set()
                seconds = time.perf_counter() - paused
            log.info("now serving version %d from %s (mode %s: paused after %.3f s, reload %.3f s, "
                     "%d requests switched)", body.version, path, body.mode, paused - start,
                     seconds, switched)
            return {"version": self.version, "reload_s": seconds, "switched": switched}

        return router

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

    @staticmethod
    def rpc_error(what: str, e: Exception) -> HTTPException:
        text = str(e) or type(e).__name__
        timed_out = isinstance(e, TimeoutError) or "timeout" in text.lower() or "timed out" in text.lower()
        return HTTPException(504 if timed_out else 500, f"{what} failed: {text[:1000]}")

    def switch(self, sampled: dict[str, int], version: int) -> int:
        """Record that the requests the worker held (internal id -> tokens sampled before the
        reload) sample with `version` from that token on. vLLM's internal ids are the external
        id plus "-" and 8 random characters (v1/engine/input_processor.py assign_request_id).

        Our requests the worker did not hold (still queued in the engine, or on their way to it)
        get no switch point, though they may sample every token with the new weights: a tag
        older than the truth never breaks the staleness bound, which only drops samples that
        are too old. A request that finished in the last step may be counted, harmlessly: its
        switch point lies past its last token.
        """
        switched = 0
        for internal_id, count in sampled.items():
            switches = self.switches.get(internal_id[:-9])
            if switches is not None:
                switches.append((count, version))
                switched += 1
        return switched

    def attach(self, app: FastAPI, engine) -> None:
        self.engine = engine
        before = len(app.router.routes)
        app.include_router(self.router())
        # Ours first, so /health answers with the version instead of vLLM's empty 200.
        ours = app.router.routes[before:]
        app.router.routes[:] = ours + app.router.routes[:before]
        if self.token:
            # Outermost. Not add_middleware: vLLM's build_app has built the stack already (its
            # SageMaker bootstrap does), which add_middleware refuses; that bootstrap rebuilds it too.
            app.user_middleware.insert(0, Middleware(TokenGuard, token=self.token))
            if app.middleware_stack is not None:
                app.middleware_stack = app.build_middleware_stack()


def vllm_args(cfg: RunConfig) -> list[str]:
    inf = cfg.inference
    args = [
        "--model", str(cfg.model),
        "--host", inf.host,
        "--port", str(inf.port),
        "--dtype", inf.dtype,
        "--max-model-len", str(cfg.seq_len),
        "--seed", str(cfg.seed),
        "--worker-extension-cls", EXTENSION,
        # Logprobs after temperature scaling: what the policy actually sampled from, and what
        # the trainer recomputes (it scales its logits by the same temperature).
        "--logprobs-mode", "processed_logprobs",
        "--gpu-memory-utilization", str(inf.gpu_memory_utilization),
        "--disable-uvicorn-access-log",
        # Per-token versions count each request's sampled tokens at a weight switch; with async
        # scheduling (a GPU default) the count can lag one placeholder token behind.
        "--no-async-scheduling",
    ]
    if inf.enforce_eager:
        args.append("--enforce-eager")
    token = resolve_token(inf.api_token)
    if token:
        # TokenGuard checks the same header first; vLLM's own check keeps /v1 closed should
        # its routes ever be served without our middleware.
        args += ["--api-key", token]
    rank = cfg.trainer.lora.rank
    if rank > 0:
        # vLLM's adapter cache no larger than its slots, and /load_lora_adapter refusing past
        # them: vLLM never evicts an adapter we serve (it would quietly reload it from disk).
        args += ["--enable-lora", "--max-lora-rank", str(min(r for r in MAX_LORA_RANKS if r >= rank)),
                 "--max-loras", str(inf.max_loras), "--max-cpu-loras", str(inf.max_loras)]
    return args + inf.extra_args


def keep_root_logging() -> Callable[[], None]:
    """Returns a function that puts the root logger's level and its handlers' levels back as
    they are now. Importing model_hosting_container_standards (vLLM's SageMaker routes, in
    build_app) sets them to ERROR unless $SAGEMAKER_CONTAINER_LOG_LEVEL says otherwise: every
    line of ours after that was lost, the readiness line and each "now serving version" included."""
    root = logging.getLogger()
    level, handlers = root.level, [(h, h.level) for h in root.handlers]

    def restore() -> None:
        root.setLevel(level)
        for handler, handler_level in handlers:
            handler.setLevel(handler_level)

    return restore


async def _serve(args, admin: AdminRoutes, restore_logging: Callable[[], None]) -> None:
    # Mirrors vllm.entrypoints.launchers.api_server.entry.run_server_worker, plus admin.attach.
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    _, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine:
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            admin.attach(app, engine)
            await init_app_state(engine, app.state, args, tasks)
            restore_logging()
            ready = asyncio.create_task(announce_when_ready(args))
            try:
                shutdown = await serve_http(
                    app, sock=sock, host=args.host, port=args.port,
                    log_level="warning", access_log=False,
                    # A request still running at shutdown (a reload waiting on the engine that
                    # just stopped) would otherwise hold the process up to reload_timeout_s.
                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                )
            finally:
                ready.cancel()
        try:
            await asyncio.wait_for(shutdown, 4 * SHUTDOWN_GRACE_S)
        except TimeoutError:
            log.warning("the HTTP server is still shutting down after %d s: exiting anyway", 4 * SHUTDOWN_GRACE_S)
    finally:
        sock.close()


async def announce_when_ready(args) -> None:
    """Log "ready: serving ..." once it is true: this server's own port answers GET /health with
    200 (the route needs no token). README tells users to wait for that line. Users took vLLM's
    own "vLLM server version ..., serving model ..." for it, which vLLM logs once the socket is
    bound, before the engine starts, 15-20 s here before uvicorn listens on it (clients got
    "Connection error"); our line, logged before serve_http, was lost (keep_root_logging)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host or "", args.host)
    scheme = "https" if args.ssl_certfile else "http"
    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{args.port}/health"
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            try:
                # ssl=False: our own certificate, reached by address, need not match its name.
                async with session.get(url, ssl=False) as r:
                    if r.status == 200:
                        version = (await r.json())["version"]
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass  # not listening yet
            await asyncio.sleep(READY_POLL_S)
    log.info("ready: serving %s on %s://%s:%d (version %d)", args.model, scheme, args.host, args.port, version)
    set_phase("serving")


def main(cfg: RunConfig) -> int:
    # rl.cli checked the config (rl/preflight.py: the port, the exposure of the admin routes, the
    # model) before calling this. Before the engine's processes exist: they must not outlive this one (inference/orphans.py).
    orphans.start()
    # The CPU engine sizes its KV cache from this variable; GPU engines ignore it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.inference.cpu_kv_cache_gib))
    # vLLM's runtime LoRA routes load adapters from any path (and resolve unknown model names
    # as adapters); /load_lora_adapter is the confined way in.
    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"):
        log.warning("VLLM_ALLOW_RUNTIME_LORA_UPDATING is ignored: use /load_lora_adapter")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "0"
    restore_logging = keep_root_logging()  # before vLLM's imports touch it
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="rl inference"))
    args = parser.parse_args(vllm_args(cfg))
    validate_parsed_serve_args(args)
    uvloop.run(_serve(args, AdminRoutes(cfg), restore_logging))
    return 0
