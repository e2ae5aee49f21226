"""The project's routes on the vLLM server, registered in one place from the route table
(rl/inference_api.py ROUTES), and the parts that answer them:

  generation.py  /generate, /abort: token ids in, tokens tagged with their policy versions out
  reload.py      /update_weights, /init_broadcaster, /broadcaster: full weights, by file or broadcast
  adapters.py    /load_lora_adapter, /unload_lora_adapter: LoRA adapters
  here           /health: the whole server's state
  openai_versions.py  the version headers on vLLM's own OpenAI routes

Request bodies that do not validate get 400 with one line naming each offending field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_type_hints

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.middleware import Middleware

from inference.access import WeightRoots, guard
from inference.adapters import Adapters
from inference import metrics
from inference.generation import Generations
from inference.openai_versions import VersionHeaders
from inference.reload import ServedWeights
from rl.config import RunConfig
from rl.heartbeat import current_instance
from rl.inference_api import ROUTES, Route, UpdateWeightsRequest, resolve_token


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


def check_handler(name: str, route: Route, handler: Callable) -> None:
    """The handler takes the route's request model as `body` and answers its response model:
    FastAPI reads both from the signature, so a mismatch would quietly serve another contract."""
    hints = get_type_hints(handler)
    assert hints.get("body") is route.request, (name, hints, route)
    assert hints["return"] is (route.response or dict), (name, hints, route)


class Routes:
    """Our routes and the parts of the server that answer them; the engine arrives with attach."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.token = resolve_token(cfg.inference.api_token)
        self.roots = WeightRoots(cfg)
        # Chosen once: the engine either was started with LoRA or was not (server.vllm_args).
        self.adapters = Adapters.for_config(cfg, self.roots)
        self.generations = Generations(cfg.seq_len, self.adapters)
        self.weights = ServedWeights(cfg, self.roots, self.generations)
        self.adapters.workers_free = self.weights.failures.check_not_overdue
        self.engine = None
        self.record_routing = cfg.inference.record_routing

    async def start_recording_routing(self) -> None:
        """With inference.record_routing: bind the recorder in each worker (before any request)."""
        if self.record_routing:
            described = await self.engine.collective_rpc("asyncrl_record_routing")
            self.generations.routing = described[0]

    def handlers(self) -> dict[str, Callable]:
        """Each route of ROUTES by name: the method that answers it."""
        return {
            "health": self.health,
            "generate": self.generations.generate,
            "abort": self.generations.abort,
            "update_weights": self.update_weights,
            "init_broadcaster": self.weights.init_broadcaster,
            "broadcaster": self.weights.broadcaster,
            "load_lora_adapter": self.adapters.load_lora_adapter,
            "unload_lora_adapter": self.adapters.unload_lora_adapter,
        }

    def router(self) -> APIRouter:
        handlers = self.handlers()
        assert handlers.keys() == ROUTES.keys(), handlers.keys() ^ ROUTES.keys()
        router = APIRouter(route_class=OneLineErrors)
        for name, route in ROUTES.items():
            check_handler(name, route, handlers[name])
            router.add_api_route(route.path, handlers[name], methods=[route.method],
                                 response_model=route.response or dict, description=route.about)
        return router

    async def update_weights(self, body: UpdateWeightsRequest) -> dict:
        """ServedWeights.update_weights, timed and counted for Prometheus (inference/metrics.py)."""
        return await metrics.timed_update(lambda: self.weights.update_weights(body), self.roots.local(body.path))

    async def health(self) -> dict:
        self.weights.failures.check_not_overdue()
        await self.engine.check_health()
        # The instance its heartbeat names: the orchestrator checks that the program answering at
        # this URL is the one its run directory announces there (orchestrator/servers/identity.py).
        return {"status": "ok", "version": self.generations.version, "path": self.weights.path,
                "instance": current_instance(),
                "running": len(self.generations.running), "aborted": self.generations.aborted,
                **self.adapters.health()}

    def attach(self, app: FastAPI, engine) -> None:
        self.engine = self.generations.engine = self.weights.engine = self.adapters.engine = engine
        metrics.attach(self.cfg, self.generations)  # beside vLLM's on /metrics
        before = len(app.router.routes)
        app.include_router(self.router())
        # Ours first, so /health answers with the version instead of vLLM's empty 200.
        ours = app.router.routes[before:]
        app.router.routes[:] = ours + app.router.routes[:before]
        # Inside the token guard (added after it, so outermost is the guard).
        app.user_middleware.insert(0, Middleware(VersionHeaders, version=lambda: self.generations.version))
        if app.middleware_stack is not None:
            app.middleware_stack = app.build_middleware_stack()
        if self.token:
            guard(app, self.token)
