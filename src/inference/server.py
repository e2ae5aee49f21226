"""`rl inference @ cfg.toml`: vLLM's OpenAI-compatible server with asyncrl's admin routes.

    rl inference @ configs/demo.toml

This is the one module that touches vLLM's server internals (pinned: vllm 0.32). It builds the
app exactly as `vllm serve` does, then puts the project's own routes in front:

  GET  /health           engine health plus the policy version now serving
  POST /update_weights   {"path", "version"}: reload in place, answer once the new weights serve

vLLM's dev-mode routes (/collective_rpc and friends) stay off: they would let any client run
methods on the workers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request
from pydantic import BaseModel

from rl.config import RunConfig
from rl.rundir import RunDir

log = logging.getLogger("inference")

EXTENSION = "inference.worker_extension.WeightReloadExtension"


class UpdateWeights(BaseModel):
    path: str
    version: int


class AdminRoutes:
    """The admin surface and the state it guards (the version now serving)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.version = 0
        self.path = str(cfg.model)
        # Weights load only from the run's weights/ and the starting model's directory.
        self.roots = [RunDir(cfg.output_dir).weights.resolve(), Path(cfg.model).resolve()]
        self.lock = asyncio.Lock()
        self.engine = None

    def check_token(self, request: Request) -> None:
        token = self.cfg.inference.api_token
        if token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got, f"Bearer {token}"):
            raise HTTPException(401, "missing or wrong bearer token (inference.api_token)")

    def confine(self, path: str) -> Path:
        resolved = Path(path).resolve()
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise HTTPException(403, f"path: {path} is outside the allowed weight roots")
        if not resolved.is_dir():
            raise HTTPException(404, f"path: {path} is not a directory")
        if not any(resolved.glob("*.safetensors")):
            raise HTTPException(422, f"path: {path} holds no *.safetensors")
        return resolved

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/health")
        async def health() -> dict:
            await self.engine.check_health()
            return {"status": "ok", "version": self.version, "path": self.path}

        @router.post("/update_weights")
        async def update_weights(body: UpdateWeights, request: Request) -> dict:
            self.check_token(request)
            path = self.confine(body.path)
            async with self.lock:
                start = time.perf_counter()
                try:
                    await self.engine.collective_rpc(
                        "asyncrl_reload_weights",
                        timeout=self.cfg.inference.reload_timeout_s,
                        args=(str(path),),
                    )
                except TimeoutError:
                    raise HTTPException(504, f"reload of {path} timed out") from None
                # Cached KV was computed by the old weights; reusing it would mix versions.
                await self.engine.reset_prefix_cache()
                self.version, self.path = body.version, str(path)
                seconds = time.perf_counter() - start
            log.info("now serving version %d from %s (reload %.3f s)", body.version, path, seconds)
            return {"version": self.version, "reload_s": seconds}

        return router

    def attach(self, app: FastAPI, engine) -> None:
        self.engine = engine
        before = len(app.router.routes)
        app.include_router(self.router())
        # Ours first, so /health answers with the version instead of vLLM's empty 200.
        ours = app.router.routes[before:]
        app.router.routes[:] = ours + app.router.routes[:before]


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
    ]
    if inf.enforce_eager:
        args.append("--enforce-eager")
    return args + inf.extra_args


async def _serve(args, admin: AdminRoutes) -> None:
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
            log.info("serving %s on http://%s:%d (version 0)", args.model, args.host, args.port)
            shutdown = await serve_http(
                app, sock=sock, host=args.host, port=args.port,
                log_level="warning", access_log=False,
            )
        await shutdown
    finally:
        sock.close()


def main(cfg: RunConfig) -> None:
    # The CPU engine sizes its KV cache from this variable; GPU engines ignore it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.inference.cpu_kv_cache_gib))
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="rl inference"))
    args = parser.parse_args(vllm_args(cfg))
    validate_parsed_serve_args(args)
    uvloop.run(_serve(args, AdminRoutes(cfg)))
