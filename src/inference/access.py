"""Who may call this server, and which directories a caller may make it read.

With a token (inference.api_token, else $ASYNCRL_API_TOKEN) every route needs it but PUBLIC
(liveness and monitoring probes): ours, vLLM's /v1 (also given to vLLM as --api-key), and what
--api-key leaves open (/invocations and /generative_scoring generate, /scale_elastic_ep
reconfigures the engine). Without a token the server refuses to bind anything but loopback
(rl/preflight.py).

A token-holder still only names paths within the weight roots: the run's weights/ and the model
the server started with (for adapters: the run's weights/ and a multi-run's runs/<run>/weights/).
The routes load whatever they find there into the engine.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import FastAPI, HTTPException
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse

from rl.weights import broadcast as bc
from rl.config import RunConfig
from rl.rundir import RunDir

# Read-only probes a load balancer or Prometheus polls without credentials; nothing here runs
# the engine or reveals more than the version served.
PUBLIC = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})
UNAUTHORIZED = "missing or wrong bearer token (inference.api_token or ASYNCRL_API_TOKEN)"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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


def guard(app: FastAPI, token: str) -> None:
    """Put TokenGuard around everything `app` serves."""
    # Outermost. Not add_middleware: vLLM's build_app has built the stack already (its
    # SageMaker bootstrap does), which add_middleware refuses; that bootstrap rebuilds it too.
    app.user_middleware.insert(0, Middleware(TokenGuard, token=token))
    if app.middleware_stack is not None:
        app.middleware_stack = app.build_middleware_stack()


class WeightRoots:
    """The directories the weight routes may read, and the paths callers name resolved into them
    (symlinks and "..", then checked: a link inside a root to outside it is outside)."""

    def __init__(self, cfg: RunConfig):
        self.model = Path(cfg.model)
        self.output_dir = Path(cfg.output_dir)
        # Weights load only from the run's weights/ and the starting model's directory.
        self.roots = [RunDir(self.output_dir).weights.resolve(), self.model.resolve()]
        self.adapter_root = RunDir(self.output_dir).weights.resolve()
        self.runs_root = (self.output_dir / "runs").resolve()

    def local(self, path: str) -> Path:
        """A path as the orchestrator sends it: relative to the run directory (every host mounts
        it where it likes), "base" for the model this server started with, or absolute."""
        if path == "base":
            return self.model
        p = Path(path)
        return p if p.is_absolute() else self.output_dir / p

    def confine(self, path: str) -> Path:
        """A directory of weights: safetensors files (a full version's, or a weight delta's), or a
        broadcast manifest."""
        resolved = self.local(path).resolve()
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise HTTPException(403, f"path: {path} is outside the allowed weight roots")
        if not resolved.is_dir():
            raise HTTPException(404, f"path: {path} is not a directory")
        if not any(resolved.glob("*.safetensors")) and not (resolved / bc.MANIFEST).is_file():
            raise HTTPException(422, f"path: {path} holds no *.safetensors and no {bc.MANIFEST}")
        return resolved

    def confine_adapter(self, path: str) -> Path:
        """A directory holding a peft adapter."""
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
