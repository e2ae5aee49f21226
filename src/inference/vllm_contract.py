"""Every vLLM internal the project touches, in one list (USES), checked against the installed vLLM
by tests/inference/test_vllm_contract.py: an upgrade that moves one fails that test, not a user's run.
docs/vllm_contract.md says how to update it at a vLLM upgrade.

Plain data, importable without vLLM. Each Use names where it lives in vLLM (a dotted module, or
MODEL_RUNNER / WORKER for the runner and worker classes picked by `runners`), what it is (kind),
which runner(s) need it, where src/ (or scripts/) uses it, and why. The test also checks the
other direction: every `vllm` import, every attribute read off a vLLM object named in RECEIVERS,
every VLLM_* variable and every `vllm serve` flag in CLI_FLAG_SOURCES must be an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- what an entry is ------------------------------------------------------------------------

MODULE_ATTR = "module attribute"  # getattr(import_module(module), name): a function, class, constant
CLASS_ATTR = "class attribute"  # "Class.attr" is on the class: a method, property, enum member
INSTANCE_ATTR = "instance attribute"  # assigned to self.<attr> in the class (or a base), or a declared field
ENV = "env variable"  # a key of vllm.envs.environment_variables
CLI_FLAG = "CLI flag"  # an option of `vllm serve`'s parser (make_arg_parser); "--flag=value": value in its choices
SOURCE_TEXT = "source text"  # a literal the project relies on appears in the module's source
# "Type.attr": the module's source assigns `<something>.attr = ...` (or a class of it declares the
# field): an attribute vLLM puts on an object that is not its own class (a torch Parameter's
# weight_loader, a model's torchao flag), or a foreign config's field.
ASSIGNED_ATTR = "attribute vLLM assigns"
KINDS = (MODULE_ATTR, CLASS_ATTR, INSTANCE_ATTR, ENV, CLI_FLAG, SOURCE_TEXT, ASSIGNED_ATTR)

RUNNERS = ("v1", "v2", "both", "cpu")
# Placeholders for `module`: the entry is checked on each class RUNNER_CLASSES / WORKER_CLASSES
# give for its runners ("both": v1 and v2). GPU runners cannot be built on CPU, so instance
# attributes are read from the classes' source.
MODEL_RUNNER = "<model runner>"
WORKER = "<worker>"
V1_RUNNERS = ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "vllm.v1.worker.cpu_model_runner:CPUModelRunner")
V2_RUNNERS = ("vllm.v1.worker.gpu.model_runner:GPUModelRunner", "vllm.v1.worker.cpu.model_runner:CPUModelRunner")
RUNNER_CLASSES = {"v1": V1_RUNNERS, "v2": V2_RUNNERS, "both": V1_RUNNERS + V2_RUNNERS,
                  "cpu": ("vllm.v1.worker.cpu_model_runner:CPUModelRunner",)}
# One worker class builds either runner: the runner choice does not change the worker.
WORKERS = ("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker")
WORKER_CLASSES = {"v1": WORKERS, "v2": WORKERS, "both": WORKERS, "cpu": ("vllm.v1.worker.cpu_worker:CPUWorker",)}
# Attribute names of our own that the worker extension and recorder put on vLLM objects.
OWN_PREFIXES = ("asyncrl_", "_asyncrl_")


@dataclass(frozen=True)
class Use:
    module: str
    """Dotted vLLM module (MODEL_RUNNER / WORKER for those classes); for ENV "vllm.envs", for
    CLI_FLAG the module of make_arg_parser."""
    name: str
    """"function", "Class.attr", "ENV_NAME", "--flag[=value]", or the literal (SOURCE_TEXT)."""
    kind: str
    runners: str
    """Which runner(s) it must exist on: "v1", "v2", "both" or "cpu" (the CPU backend only)."""
    used_in: tuple[str, ...]
    """"path:Qualified.name" in this repository for each place that relies on it."""
    why: str
    keywords: tuple[str, ...] = ()
    """Parameters a call passes by these names (callables only): each must be in the signature."""
    via: str = ""
    """Set when src/ does not name it (so the used_in check looks for no name): how src/ relies on
    it anyway, e.g. the entry that calls it."""


# --- where src/ holds vLLM objects (for the coverage test) -----------------------------------

CLI = "<vllm serve args>"  # parsed `vllm serve` arguments: attribute = a CLI_FLAG's dest


def foreign(owner: str) -> bool:
    """A receiver's owner that is no vLLM class ("torch.nn:Module", "builtins:dict"): attributes of
    that class need no entry, any other one an ASSIGNED_ATTR entry "Class.attr"."""
    return owner not in (MODEL_RUNNER, WORKER, CLI) and not owner.startswith("vllm")


@dataclass(frozen=True)
class Receiver:
    """In `path` (within `scope`, a dotted def/class name; "" the whole file) the expression
    `expr` is a vLLM object of `owner` ("module:Class", "module:" for a module, MODEL_RUNNER,
    WORKER or CLI), or an object reached from one (a call's result, a loop variable over one) of
    a `foreign` owner: each attribute read or set on it, or named in getattr/hasattr, needs an
    entry. The test follows every chain from a receiver (attributes, calls, subscripts, names
    assigned from them): an object reached so that no receiver names is reported."""

    path: str
    scope: str
    expr: str
    owner: str


SERVER, DEVICE = "src/inference/server.py", "src/inference/device_defaults.py"
EXT, ROUTING = "src/inference/worker_extension.py", "src/inference/routing_capture.py"
GEN, RELOAD = "src/inference/generation.py", "src/inference/reload.py"
ALL_WORKERS = "src/inference/all_workers.py"
ADAPTERS, ROUTES = "src/inference/adapters.py", "src/inference/routes.py"
KEPT, PREFLIGHT = "src/inference/kept_sets.py", "src/inference/preflight.py"
PLACEMENT, GPU_PLACEMENT = "src/rl/placement.py", "src/rl/gpu_placement.py"
CHAT_MODEL, REAL_MODEL = "scripts/make_chat_model.py", "scripts/make_real_size_model.py"
TOOL_MODEL, GPU_CHECK = "scripts/make_tool_model.py", "scripts/gpu_check_items.py"
VLM_MODEL, MULTIMODAL = "scripts/make_vlm_model.py", "src/inference/multimodal.py"
GPU_CHECK_PLACEMENT = "scripts/gpu_check_placement.py"

ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner"
LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"

RECEIVERS = (
    *(Receiver(p, "", "self.engine", ASYNC_LLM) for p in (GEN, RELOAD, ADAPTERS, ROUTES)),
    Receiver(GEN, "", "self.engine.model_config", "vllm.config.model:ModelConfig"),
    Receiver(GEN, "Generations.tagged", "final", "vllm.outputs:RequestOutput"),
    Receiver(GEN, "Generations.sample", "final", "vllm.outputs:RequestOutput"),
    Receiver(RELOAD, "", "self.engine.model_config", "vllm.config.model:ModelConfig"),
    Receiver(GEN, "Generations.tagged", "c", "vllm.outputs:CompletionOutput"),
    Receiver(GEN, "Generations.tagged", "c.logprobs[j][t]", "vllm.logprobs:Logprob"),
    Receiver(GEN, "Generations.tagged", "d[t]", "vllm.logprobs:Logprob"),
    # Our worker methods' answers, through collective_rpc.
    Receiver(GEN, "Generations.attach_routing", "taken", "builtins:dict"),
    Receiver(GEN, "token_versions", "span", "vllm.outputs:WeightVersionSpan"),
    Receiver(ALL_WORKERS, "", "engine", ASYNC_LLM),
    Receiver(ALL_WORKERS, "every_worker", "core", "vllm.v1.engine.core_client:AsyncMPClient"),
    Receiver(RELOAD, "ServedWeights.pause", "core", "vllm.v1.engine.core_client:AsyncMPClient"),
    Receiver(RELOAD, "", "self.engine.vllm_config", "vllm.config.vllm:VllmConfig"),
    Receiver(RELOAD, "", "self.engine.vllm_config.parallel_config", "vllm.config.parallel:ParallelConfig"),
    Receiver(ADAPTERS, "", "lora", "vllm.lora.request:LoRARequest"),
    Receiver(ADAPTERS, "Adapter", "self.request", "vllm.lora.request:LoRARequest"),
    *(Receiver(p, "", "adapter.request", "vllm.lora.request:LoRARequest") for p in (ADAPTERS, GEN)),
    Receiver(KEPT, "", "lp", "vllm.logprobs:Logprob"),
    Receiver(SERVER, "", "engine", ASYNC_LLM),
    Receiver(SERVER, "", "current_platform", "vllm.platforms.interface:Platform"),
    Receiver(SERVER, "forked_engine_client", "engine_args", "vllm.engine.arg_utils:AsyncEngineArgs"),
    Receiver(SERVER, "forked_engine_client", "vllm_config", "vllm.config.vllm:VllmConfig"),
    *(Receiver(SERVER, f, "args", CLI) for f in ("_serve", "announce_when_ready")),
    Receiver(EXT, "WeightReloadExtension", "self", WORKER),
    Receiver(EXT, "", "self.model_runner", MODEL_RUNNER),
    Receiver(EXT, "", "self.model_runner.model_config", "vllm.config.model:ModelConfig"),
    Receiver(EXT, "", "self.model_runner.get_model()", "torch.nn:Module"),
    Receiver(EXT, "", "self.model_runner.model_config.hf_text_config", "transformers:PretrainedConfig"),
    Receiver(EXT, "WeightReloadExtension._asyncrl_tied_lm_head", "lm_head", "torch.nn:Module"),
    Receiver(EXT, "WeightReloadExtension._asyncrl_fix_tied_lm_head", "lm_head.quant_method",
             "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod"),
    Receiver(EXT, "repack_cpu_experts", "module", MOE_RUNNER),
    Receiver(EXT, "repack_cpu_experts", "layer", "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts"),
    Receiver(EXT, "repack_cpu_experts", "layer.quant_method",
             "vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase"),
    Receiver(EXT, "repack_cpu_experts", "getattr(layer.quant_method, 'moe_kernel', None)",
             "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEKernel"),
    Receiver(EXT, "repack_cpu_experts", "experts",
             "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts"),
    Receiver(EXT, "_end_interrupted_reload", "layerwise", f"{LAYERWISE}:"),
    Receiver(EXT, "_end_interrupted_reload", "model", "torch.nn:Module"),
    Receiver(EXT, "_end_interrupted_reload", "layerwise.LAYERWISE_INFO", "weakref:WeakKeyDictionary"),
    Receiver(EXT, "_end_interrupted_reload", "layerwise.LOADING_LAYERS", "weakref:WeakSet"),
    Receiver(EXT, "_end_interrupted_reload", "layerwise.get_layer_tensors(layer)", "builtins:dict"),
    Receiver(EXT, "_end_interrupted_reload", "tensor", "torch.nn:Parameter"),
    Receiver(EXT, "_end_interrupted_reload", "info",
             "vllm.model_executor.model_loader.reload.types:LayerReloadingInfo"),
    Receiver(ROUTING, "", "worker", WORKER),
    Receiver(ROUTING, "", "runner", MODEL_RUNNER),
    Receiver(ROUTING, "", "runner.input_batch", "vllm.v1.worker.gpu_input_batch:InputBatch"),
    Receiver(ROUTING, "", "runner.query_start_loc", "vllm.v1.utils:CpuGpuBuffer"),
    Receiver(ROUTING, "bind", "runner.query_start_loc.np", "numpy:ndarray"),
    Receiver(ROUTING, "bind", "runner.positions", "torch:Tensor"),
    Receiver(ROUTING, "RoutingRecorder.bound_to", "m", MOE_RUNNER),
    Receiver(ROUTING, "RoutingRecorder.bound_to", "m.router",
             "vllm.model_executor.layers.fused_moe.router.fused_moe_router:FusedMoERouter"),
    Receiver(ROUTING, "RoutingRecorder.bound_to", "config",
             "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig"),
    Receiver(ROUTING, "bind", "scheduler_output", "vllm.v1.core.sched.output:SchedulerOutput"),
)

# Files (and top-level names in them; () the whole file) whose "--flag" strings are `vllm serve` flags.
CLI_FLAG_SOURCES = {SERVER: (), DEVICE: ("parallel_args",), GPU_PLACEMENT: ("PARALLEL_FLAGS",)}
# Where the test looks for `vllm` imports and VLLM_* variables (all but this file, which names them).
SCANNED = ("src", "scripts")
THIS_FILE = "src/inference/vllm_contract.py"

# --- the entries --------------------------------------------------------------------------------

CLI_ARGS = "vllm.entrypoints.launchers.cli_args"
ENVS = "vllm.envs"
CONFIG_MODEL, OUTPUTS = "vllm.config.model", "vllm.outputs"
CORE_CLIENT = "vllm.v1.engine.core_client"
MOE = "vllm.model_executor.layers.fused_moe"
ENGINE = "vllm.v1.engine.async_llm"  # AsyncLLM, the engine client every route calls


def _flags(names: str, used_in: tuple[str, ...], why: str) -> tuple[Use, ...]:
    """CLI_FLAG entries for several flags that share where and why."""
    return tuple(Use(CLI_ARGS, n, CLI_FLAG, "both", used_in, why) for n in names.split())


USES: tuple[Use, ...] = (
    # --- the server: built as `vllm serve` builds it (inference/server.py) ---------------------
    Use("vllm.platforms", "current_platform", MODULE_ATTR, "both", (f"{SERVER}:engine_in_one_process",),
        "asks whether the engine is a CPU one before choosing a one-process engine"),
    Use("vllm.platforms.interface", "Platform.is_cpu", CLASS_ATTR, "both", (f"{SERVER}:engine_in_one_process",),
        "the CPU platform is the one whose single worker can run inside the engine core"),
    Use("vllm.utils.cpu_resource_utils", "parse_id_list", MODULE_ATTR, "cpu", (f"{SERVER}:bind_engine_cores",),
        "reads $VLLM_CPU_OMP_THREADS_BIND's core list as vLLM's CPU worker does"),
    Use("vllm.engine.arg_utils", "AsyncEngineArgs", MODULE_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "the engine config of a forked engine core, built as vLLM's own client builds it"),
    Use("vllm.engine.arg_utils", "AsyncEngineArgs.from_cli_args", CLASS_ATTR, "both",
        (f"{SERVER}:forked_engine_client",), "engine arguments from the parsed `vllm serve` flags"),
    Use("vllm.engine.arg_utils", "AsyncEngineArgs.create_engine_config", CLASS_ATTR, "both",
        (f"{SERVER}:forked_engine_client",), "the VllmConfig the forked engine runs", ("usage_context",)),
    *(Use("vllm.engine.arg_utils", f"AsyncEngineArgs.{a}", INSTANCE_ATTR, "both", (f"{SERVER}:forked_engine_client",),
          "passed on to AsyncLLM.from_vllm_config as vLLM's client does")
      for a in ("enable_log_requests", "aggregate_engine_logging", "disable_log_stats")),
    Use(CLI_ARGS, "propagate_flash_late_interaction", MODULE_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "a step of vLLM's own engine-args setup, repeated for the forked engine"),
    Use("vllm.usage.usage_lib", "UsageContext", MODULE_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "the usage context vLLM's OpenAI server passes"),
    Use("vllm.usage.usage_lib", "UsageContext.OPENAI_API_SERVER", CLASS_ATTR, "both",
        (f"{SERVER}:forked_engine_client",), "the usage context vLLM's OpenAI server passes"),
    Use("vllm.config.vllm", "VllmConfig.shutdown_timeout", INSTANCE_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "how long the forked engine core gets to exit (--shutdown-timeout)"),
    Use(ENGINE, "AsyncLLM", MODULE_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "the engine client every route calls"),
    Use(ENGINE, "AsyncLLM.from_vllm_config", CLASS_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "starts the engine core (forked) and its client",
        ("vllm_config", "usage_context", "enable_log_requests", "aggregate_engine_logging", "disable_log_stats")),
    Use(ENGINE, "AsyncLLM.reset_mm_cache", CLASS_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "as vLLM's client does after start: no dummy multimodal data kept"),
    Use(ENGINE, "AsyncLLM.shutdown", CLASS_ATTR, "both", (f"{SERVER}:forked_engine_client",),
        "stops the forked engine core", ("timeout",)),
    Use(ENGINE, "AsyncLLM.get_supported_tasks", CLASS_ATTR, "both", (f"{SERVER}:_serve",),
        "what build_app and init_app_state serve"),
    Use(ENGINE, "AsyncLLM.model_config", INSTANCE_ATTR, "both",
        (f"{SERVER}:_serve", f"{GEN}:Generations.check", f"{GEN}:Generations.sample",
         f"{RELOAD}:ServedWeights.switch_to"),
        "the app's model config; the vocabulary and --max-logprobs a /generate is checked against"),
    Use("vllm.entrypoints.launchers.api_server.app_state", "init_app_state", MODULE_ATTR, "both", (f"{SERVER}:_serve",),
        "vLLM's OpenAI routes' state, as run_server_worker sets it up"),
    Use("vllm.entrypoints.launchers.api_server.entry", "build_async_engine_client", MODULE_ATTR, "both",
        (f"{SERVER}:_serve",), "vLLM's own engine client when the engine core is not forked"),
    Use("vllm.entrypoints.launchers.app", "build_app", MODULE_ATTR, "both", (f"{SERVER}:_serve",),
        "vLLM's FastAPI app, which routes.attach puts our routes in front of"),
    Use("vllm.entrypoints.launchers.launcher", "serve_http", MODULE_ATTR, "both", (f"{SERVER}:_serve",),
        "serves the app on the socket setup_server bound", ("sock",)),
    Use("vllm.entrypoints.launchers.launcher", "setup_server", MODULE_ATTR, "both", (f"{SERVER}:_serve",),
        "binds the server's socket before the engine starts", ("reuse_port",)),
    Use(CLI_ARGS, "make_arg_parser", MODULE_ATTR, "both", (f"{SERVER}:main",), "`vllm serve`'s own flags"),
    Use(CLI_ARGS, "validate_parsed_serve_args", MODULE_ATTR, "both", (f"{SERVER}:main",),
        "vLLM's own checks of the parsed flags"),
    Use("vllm.entrypoints.serve.utils.api_utils", "cli_env_setup", MODULE_ATTR, "both", (f"{SERVER}:main",),
        "the environment `vllm serve` sets up before parsing"),
    Use("vllm.utils.argparse_utils", "FlexibleArgumentParser", MODULE_ATTR, "both", (f"{SERVER}:main",),
        "the parser class make_arg_parser extends"),
    Use("vllm.config.lora", "MaxLoRARanks", MODULE_ATTR, "both", (f"{SERVER}:MAX_LORA_RANKS",),
        "the --max-lora-rank values vLLM accepts (the test compares them)", via="MAX_LORA_RANKS copies its values"),
    Use("vllm.v1.engine.input_processor", "-{random_uuid():.8}", SOURCE_TEXT, "both", (f"{ROUTING}:external_id",),
        "an internal request id is the external one plus '-' and 8 characters: the recorder strips 9"),
    # --- environment variables ----------------------------------------------------------------
    Use(ENVS, "VLLM_CPU_KVCACHE_SPACE", ENV, "cpu",
        (f"{SERVER}:main", f"{PREFLIGHT}:inference_memory", f"{REAL_MODEL}:check", f"{TOOL_MODEL}:check_vllm"),
        "sizes the CPU engine's KV cache (else a share of the machine's memory it may refuse)"),
    Use(ENVS, "VLLM_ALLOW_RUNTIME_LORA_UPDATING", ENV, "both", (f"{SERVER}:main",),
        "kept 0: vLLM's runtime LoRA routes would load adapters from any path"),
    Use(ENVS, "VLLM_USE_V2_MODEL_RUNNER", ENV, "both", (f"{SERVER}:main", f"{GPU_CHECK_PLACEMENT}:check_reload_v2"),
        "0 when recording routing (the recorder reads the V1 runner's layout); 1 to check reloads on V2"),
    Use(ENVS, "VLLM_ENABLE_V1_MULTIPROCESSING", ENV, "cpu", (f"{SERVER}:main",),
        "0 keeps a one-worker CPU engine's worker inside the engine core"),
    Use(ENVS, "VLLM_WORKER_MULTIPROC_METHOD", ENV, "cpu", (f"{SERVER}:forked_engine_client",),
        "fork, after the CPU platform asked for spawn: the engine core is forked"),
    Use("vllm.config.vllm", 'os.environ.get("TORCH_COMPILE_DISABLE") == "1"', SOURCE_TEXT, "cpu", (f"{SERVER}:main",),
        "torch's own switch, which vLLM reads as -cc.mode=none: an eager CPU engine's (device_defaults.compile_off)"),
    Use("vllm.v1.sample.ops.logprobs", "@torch.compile(backend=current_platform.simple_compile_backend)",
        SOURCE_TEXT, "cpu", (f"{SERVER}:main",),
        "the helper whose compile at the first logprobs request TORCH_COMPILE_DISABLE saves (2.4 s of CPU)"),
    Use(ENVS, "VLLM_CPU_OMP_THREADS_BIND", ENV, "cpu", (f"{SERVER}:bind_engine_cores", f"{PLACEMENT}:pin"),
        "the cores the CPU engine's OpenMP threads run on"),
    # --- `vllm serve` flags (inference/server.py vllm_args) -----------------------------------
    *_flags("--model --host --port", (f"{SERVER}:vllm_args", f"{SERVER}:announce_when_ready"),
            "where the server serves what; read back to announce readiness"),
    *_flags("--dtype --max-model-len --seed --shutdown-timeout --max-logprobs --api-key", (f"{SERVER}:vllm_args",),
            "engine settings from the run config"),
    *_flags("--worker-extension-cls", (f"{SERVER}:vllm_args",),
            "mixes inference.worker_extension into every worker (the reload and routing RPCs)"),
    *_flags("--logprobs-mode=processed_logprobs", (f"{SERVER}:vllm_args",),
            "logprobs after temperature and truncation: what the trainer recomputes; kept sets read them"),
    *_flags("--disable-uvicorn-access-log", (f"{SERVER}:vllm_args",), "no line per request in the log"),
    *_flags("--enforce-eager", (f"{SERVER}:vllm_args",), "no CUDA graphs (device_defaults.eager)"),
    *_flags("--no-enable-prefix-caching", (f"{SERVER}:vllm_args",),
            "cached prompt blocks skip the routers, whose record the routing capture needs"),
    *_flags("--enable-auto-tool-choice --tool-call-parser", (f"{SERVER}:vllm_args",), "tools= on the chat route"),
    *_flags("--gpu-memory-utilization", (f"{SERVER}:vllm_args",), "inference.gpu_memory_utilization"),
    *_flags("--enable-lora --max-lora-rank --max-loras --max-cpu-loras", (f"{SERVER}:vllm_args",),
            "LoRA serving with one slot more than filled (see vllm_args)"),
    *_flags("--tensor-parallel-size --data-parallel-size",
            (f"{SERVER}:MULTI_WORKER_FLAGS", f"{GPU_PLACEMENT}:PARALLEL_FLAGS", f"{DEVICE}:parallel_args"),
            "set from inference.tensor_parallel and inference.gpus; looked for in extra_args"),
    *_flags("-tp -dp", (f"{SERVER}:MULTI_WORKER_FLAGS", f"{GPU_PLACEMENT}:PARALLEL_FLAGS"),
            "short forms of the parallel flags, looked for in extra_args"),
    *_flags("--pipeline-parallel-size -pp", (f"{SERVER}:MULTI_WORKER_FLAGS",),
            "flags that give the engine more than one worker, looked for in extra_args"),
    *_flags("--distributed-executor-backend", (f"{SERVER}:MULTI_WORKER_FLAGS", f"{SERVER}:main"),
            "looked for in extra_args; set to uni for a one-process CPU engine"),
    *_flags("--ssl-certfile", (f"{SERVER}:announce_when_ready",), "https or http for the readiness probe"),
    # --- the engine client's calls (reload.py, generation.py, adapters.py, routes.py) --------
    Use(ENGINE, "AsyncLLM.collective_rpc", CLASS_ATTR, "both",
        (f"{ALL_WORKERS}:every_worker", f"{GEN}:Generations.attach_routing",
         f"{ROUTES}:Routes.start_recording_routing"),
        "runs the worker extension's methods on every worker", ("timeout", "args")),
    Use(CORE_CLIENT, "AsyncMPClient.call_utility_all_async", CLASS_ATTR, "both", (f"{ALL_WORKERS}:every_worker",),
        "each engine's answers to a utility call: every data-parallel rank's workers, where collective_rpc "
        "answers with rank 0's (tests/inference/test_vllm_contract.py pins both)"),
    Use("vllm.v1.engine.core", "EngineCore.collective_rpc", CLASS_ATTR, "both", (f"{ALL_WORKERS}:every_worker",),
        "the utility every_worker names, called with (method, timeout, args, kwargs)",
        ("method", "timeout", "args", "kwargs"), via="the utility name \"collective_rpc\""),
    Use(ENGINE, "AsyncLLM.vllm_config", INSTANCE_ATTR, "both", (f"{RELOAD}:ServedWeights.workers",),
        "the engine's parallel config: how many broadcast ranks its workers are"),
    Use("vllm.config.vllm", "VllmConfig.parallel_config", INSTANCE_ATTR, "both", (f"{RELOAD}:ServedWeights.workers",),
        "the engine's parallel config"),
    Use("vllm.config.parallel", "ParallelConfig.world_size", INSTANCE_ATTR, "both",
        (f"{RELOAD}:ServedWeights.workers",),
        "workers of the engine (tensor x pipeline parallel), each one broadcast rank"),
    Use(ENGINE, "AsyncLLM.engine_core", INSTANCE_ATTR, "both",
        (f"{RELOAD}:ServedWeights.pause", f"{ALL_WORKERS}:every_worker"),
        "the engine core client, paused directly (pause_generation sleeps 20 ms more), asked for every "
        "engine's answers"),
    Use(CORE_CLIENT, "AsyncMPClient.pause_scheduler_async", CLASS_ATTR, "both", (f"{RELOAD}:ServedWeights.pause",),
        "stops the scheduler between two steps for a reload", ("mode", "clear_cache")),
    Use(ENGINE, "AsyncLLM.pause_generation", CLASS_ATTR, "both", (f"{RELOAD}:ServedWeights.pause",),
        "the fallback pause when the engine core client has no pause_scheduler_async", ("mode", "clear_cache")),
    Use(ENGINE, "AsyncLLM.resume_generation", CLASS_ATTR, "both", (f"{RELOAD}:ServedWeights.switch_to",),
        "resumes the engine after a reload"),
    Use(ENGINE, "AsyncLLM.reset_prefix_cache", CLASS_ATTR, "both", (f"{RELOAD}:ServedWeights.switch_to",),
        "cached KV of the old weights must not seed new requests"),
    Use(ENGINE, "AsyncLLM.abort", CLASS_ATTR, "both",
        (f"{RELOAD}:ServedWeights.break_down", f"{GEN}:Generations.abort"),
        "stops engine requests by their external ids"),
    Use(ENGINE, "AsyncLLM.update_weight_version", CLASS_ATTR, "both", (f"{GEN}:Generations.label",),
        "labels the weights with the new version while paused (reload.py switch_to): per-token versions"),
    Use(CORE_CLIENT, "AsyncMPClient.set_weight_version_async", CLASS_ATTR, "both", (f"{GEN}:Generations.label",),
        "how the label reaches the engine core, which tags each step's output with it",
        via="AsyncLLM.update_weight_version"),
    Use("vllm.v1.executor.multiproc_executor", "Worker failed with error", SOURCE_TEXT, "both",
        (f"{ALL_WORKERS}:may_still_run",), "tells a worker's error answer from a timed-out call still running"),
    Use(ENGINE, "AsyncLLM.generate", CLASS_ATTR, "both", (f"{GEN}:Generations.sample",),
        "runs one engine request from token ids", ("lora_request",)),
    Use(ENGINE, "AsyncLLM.add_lora", CLASS_ATTR, "both", (f"{ADAPTERS}:Adapters.add",), "loads a LoRA adapter"),
    Use(ENGINE, "AsyncLLM.remove_lora", CLASS_ATTR, "both", (f"{ADAPTERS}:Adapters.unload_lora_adapter",),
        "drops a LoRA adapter"),
    Use(ENGINE, "AsyncLLM.errored", CLASS_ATTR, "both", (f"{ADAPTERS}:Adapters.add",),
        "whether an adapter load killed the engine (500) or was refused (422)"),
    Use(ENGINE, "AsyncLLM.check_health", CLASS_ATTR, "both", (f"{ROUTES}:Routes.health",), "/health asks the engine"),
    Use(CONFIG_MODEL, "ModelConfig.get_vocab_size", CLASS_ATTR, "both",
        (f"{GEN}:Generations.check", f"{GEN}:Generations.sample"), "token ids and kept sets are checked against it"),
    Use(CONFIG_MODEL, "ModelConfig.max_logprobs", INSTANCE_ATTR, "both", (f"{GEN}:Generations.check",),
        "--max-logprobs, which bounds kept sets"),
    # --- sampling and outputs (generation.py, kept_sets.py) ----------------------------------
    Use("vllm.inputs.engine", "tokens_input", MODULE_ATTR, "both", (f"{GEN}:Generations.run",),
        "a rendered prompt keeps vLLM off its tokenizer thread pool", ("cache_salt",)),
    # --- images on /generate (multimodal.py) ---------------------------------------------------
    Use("vllm.renderers.inputs.preprocess", "parse_model_prompt", MODULE_ATTR, "both", (f"{MULTIMODAL}:image_input",),
        "the prompt as render_cmpl_async takes it"),
    Use(ENGINE, "AsyncLLM.reset_encoder_cache", CLASS_ATTR, "both", (f"{RELOAD}:ServedWeights.switch_to",),
        "after a reload: the scheduler's record of cached image encodings (the worker clears its own)"),
    Use(ENGINE, "AsyncLLM.renderer", INSTANCE_ATTR, "both", (f"{MULTIMODAL}:image_input",),
        "its renderer expands image placeholders and computes pixels, as vLLM's own routes do"),
    Use("vllm.renderers.base", "BaseRenderer.render_cmpl_async", CLASS_ATTR, "both", (f"{MULTIMODAL}:image_input",),
        "renders a multi-modal token prompt to the engine's input"),
    Use(CONFIG_MODEL, "ModelConfig.is_multimodal_model", CLASS_ATTR, "both",
        (f"{MULTIMODAL}:image_input", f"{RELOAD}:ServedWeights.switch_to"),
        "images for a text-only model are refused by field; a reload resets a VLM's encoder cache"),
    Use(CONFIG_MODEL, "ModelConfig.hf_config", INSTANCE_ATTR, "both", (f"{MULTIMODAL}:image_input",),
        "its image_token_id: one placeholder per image, checked before the renderer"),
    Use(OUTPUTS, "RequestOutput.prompt_token_ids", INSTANCE_ATTR, "both",
        (f"{GEN}:Generations.sample", f"{GEN}:Generations.tagged"),
        "the prompt as the engine expanded its image placeholders (answered with images)"),
    Use("vllm", "SamplingParams", MODULE_ATTR, "both",
        (f"{GEN}:Generations.sample", f"{CHAT_MODEL}:check_vllm", f"{REAL_MODEL}:check", f"{TOOL_MODEL}:check_vllm",
         f"{VLM_MODEL}:check_vllm"),
        "the sampler's settings per request",
        ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "logprobs",
         "prompt_logprobs", "output_kind", "detokenize", "ignore_eos", "allowed_token_ids")),
    Use("vllm.sampling_params", "RequestOutputKind", MODULE_ATTR, "both", (f"{GEN}:Generations.sample",),
        "only the final output of each request"),
    Use("vllm.sampling_params", "RequestOutputKind.FINAL_ONLY", CLASS_ATTR, "both", (f"{GEN}:Generations.sample",),
        "only the final output of each request"),
    Use(OUTPUTS, "RequestOutput.outputs", INSTANCE_ATTR, "both", (f"{GEN}:Generations.tagged",), "the sample"),
    Use(OUTPUTS, "RequestOutput.prompt_logprobs", INSTANCE_ATTR, "both", (f"{GEN}:Generations.tagged",),
        "the prompt's logprobs (prompt_logprobs on /generate)"),
    *(Use(OUTPUTS, f"CompletionOutput.{a}", INSTANCE_ATTR, "both", (f"{GEN}:Generations.tagged",),
          "the sampled tokens, their logprobs and why the request ended")
      for a in ("token_ids", "logprobs", "finish_reason")),
    Use(OUTPUTS, "CompletionOutput.weight_versions", INSTANCE_ATTR, "both", (f"{GEN}:Generations.tagged",),
        "the weight-version label spans of the request's tokens: each token's policy version"),
    *(Use(OUTPUTS, f"WeightVersionSpan.{a}", INSTANCE_ATTR, "both", (f"{GEN}:token_versions",),
          "a span of tokens [start, end) sampled by weights labelled version")
      for a in ("version", "start", "end")),
    Use("vllm.logprobs", "Logprob.logprob", INSTANCE_ATTR, "both", (f"{GEN}:Generations.tagged", f"{KEPT}:kept_sets"),
        "each token's logprob; -inf outside the kept set with processed logprobs"),
    Use("vllm.logprobs", "Logprob.rank", INSTANCE_ATTR, "both", (f"{KEPT}:kept_sets",),
        "which entries are the top `asked` ones"),
    # --- LoRA (adapters.py) --------------------------------------------------------------------
    Use("vllm.lora.request", "LoRARequest", MODULE_ATTR, "both", (f"{ADAPTERS}:Adapters.load_lora_adapter",),
        "an adapter as the engine knows it, made as LoRARequest(name, id, path)",
        ("lora_name", "lora_int_id", "lora_path")),
    Use("vllm.lora.request", "LoRARequest.lora_int_id", INSTANCE_ATTR, "both",
        (f"{ADAPTERS}:Adapters.load_lora_adapter", f"{ADAPTERS}:Adapters.unload_lora_adapter",
         f"{GEN}:Generations.weights_in_use"), "the engine's adapter id: unload and cache salt"),
    Use("vllm.lora.request", "LoRARequest.lora_name", INSTANCE_ATTR, "both", (f"{ADAPTERS}:Adapters.add",),
        "named in load errors"),
    Use("vllm.lora.request", "LoRARequest.lora_path", INSTANCE_ATTR, "both", (f"{ADAPTERS}:Adapter.path",),
        "where a loaded adapter came from"),
    # --- the worker and its model runner (worker_extension.py, routing_capture.py) ------------
    Use(WORKER, "model_runner", INSTANCE_ATTR, "both",
        (f"{EXT}:WeightReloadExtension.asyncrl_reload_weights", f"{ROUTING}:bind"),
        "the worker's model runner, whose model is reloaded and whose forwards are recorded"),
    Use(WORKER, "reload_weights", CLASS_ATTR, "both",
        (f"{EXT}:WeightReloadExtension.asyncrl_reload_weights", f"{EXT}:WeightReloadExtension._asyncrl_load_tensors"),
        "in-place reload (forwards to the runner's under the current vllm config)"),
    Use(WORKER, "rank", INSTANCE_ATTR, "both", (f"{EXT}:WeightReloadExtension.asyncrl_init_broadcaster",),
        "this worker's rank: its rank in the trainer's broadcast group"),
    Use(WORKER, "device", INSTANCE_ATTR, "both", (f"{EXT}:WeightReloadExtension.asyncrl_init_broadcaster",),
        "where broadcast tensors arrive"),
    Use(MODEL_RUNNER, "get_model", CLASS_ATTR, "both",
        (f"{EXT}:WeightReloadExtension.asyncrl_reload_weights", f"{ROUTING}:bind"),
        "the nn.Module the reload and the routing recorder work on"),
    Use(MODEL_RUNNER, "model_config", INSTANCE_ATTR, "both", (f"{EXT}:WeightReloadExtension._asyncrl_tied_lm_head",),
        "whether the model ties its lm_head to the embedding"),
    Use(MODEL_RUNNER, "reload_weights", CLASS_ATTR, "both",
        (f"{EXT}:WeightReloadExtension.asyncrl_reload_weights", f"{EXT}:WeightReloadExtension._asyncrl_load_tensors"),
        "what the worker's reload_weights passes our keywords on to", ("weights_path", "weights_iterator"),
        via="<worker>.reload_weights"),
    Use(CONFIG_MODEL, "ModelConfig.hf_text_config", INSTANCE_ATTR, "both",
        (f"{EXT}:WeightReloadExtension._asyncrl_tied_lm_head",), "tie_word_embeddings of the text model"),
    Use(MODEL_RUNNER, "execute_model", CLASS_ATTR, "v1", (f"{ROUTING}:bind",),
        "wrapped: after each forward the recorder files its rows"),
    *(Use(MODEL_RUNNER, a, INSTANCE_ATTR, "v1", (f"{ROUTING}:bind",),
          "the V1 runner's layout of the last forward: request order, token offsets, positions")
      for a in ("input_batch", "query_start_loc", "positions")),
    Use("vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs", CLASS_ATTR, "v1", (f"{ROUTING}:bind",),
        "requests in the last forward"),
    Use("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", CLASS_ATTR, "v1", (f"{ROUTING}:bind",),
        "their internal ids, in forward order"),
    Use("vllm.v1.utils", "CpuGpuBuffer.np", INSTANCE_ATTR, "v1", (f"{ROUTING}:bind",),
        "query_start_loc's host copy"),
    *(Use("vllm.v1.core.sched.output", f"SchedulerOutput.{a}", INSTANCE_ATTR, "both", (f"{ROUTING}:bind",),
          "tokens in the step, and the requests finished by it")
      for a in ("total_num_scheduled_tokens", "finished_req_ids")),
    # --- MoE routers and experts (routing_capture.py, worker_extension.py) --------------------
    Use(f"{MOE}.runner.moe_runner", "MoERunner", MODULE_ATTR, "both",
        (f"{ROUTING}:RoutingRecorder.bound_to", f"{EXT}:repack_cpu_experts"), "finds the MoE layers"),
    *(Use(f"{MOE}.runner.moe_runner", f"MoERunner.{a}", INSTANCE_ATTR, "both", (f"{ROUTING}:RoutingRecorder.bound_to",),
          "each MoE layer's config and router") for a in ("moe_config", "router")),
    Use(f"{MOE}.runner.moe_runner", "MoERunner.layer_id", CLASS_ATTR, "both", (f"{ROUTING}:RoutingRecorder.bound_to",),
        "the MoE layer's index in the model"),
    Use(f"{MOE}.runner.moe_runner", "MoERunner.routed_experts", INSTANCE_ATTR, "cpu", (f"{EXT}:repack_cpu_experts",),
        "the experts whose CPU packing a reload skips"),
    *(Use(f"{MOE}.config", f"FusedMoEConfig.{a}", INSTANCE_ATTR, "both", (f"{ROUTING}:RoutingRecorder.bound_to",),
          "top_k and the expert count (the rows' dtype)") for a in ("experts_per_token", "num_logical_experts")),
    Use(f"{MOE}.router.fused_moe_router", "FusedMoERouter.set_capture_fn", CLASS_ATTR, "both",
        (f"{ROUTING}:RoutingRecorder.bound_to",), "the recorder's hook on every router"),
    Use(f"{MOE}.router.base_router", "self.capture_fn(topk_ids)", SOURCE_TEXT, "both",
        (f"{ROUTING}:RoutingRecorder.capture",), "routers call the hook with the logical expert ids they chose"),
    Use(f"{MOE}.experts.cpu_moe", "CPUUnquantizedExperts", MODULE_ATTR, "cpu", (f"{EXT}:repack_cpu_experts",),
        "the CPU MoE kernel whose packed weights a reload leaves stale"),
    Use(f"{MOE}.experts.cpu_moe", "CPUUnquantizedExperts.process_weights_after_loading", CLASS_ATTR, "cpu",
        (f"{EXT}:repack_cpu_experts",), "packs the reloaded expert weights again"),
    Use(f"{MOE}.routed_experts", "RoutedExperts.quant_method", INSTANCE_ATTR, "cpu", (f"{EXT}:repack_cpu_experts",),
        "leads to the experts' kernel"),
    Use(f"{MOE}.fused_moe_method_base", "FusedMoEMethodBase.moe_kernel", INSTANCE_ATTR, "cpu",
        (f"{EXT}:repack_cpu_experts",), "leads to the experts' kernel"),
    Use(f"{MOE}.modular_kernel", "FusedMoEKernel.fused_experts", CLASS_ATTR, "cpu", (f"{EXT}:repack_cpu_experts",),
        "the experts' kernel"),
    # --- the tied lm_head and the layerwise reload (worker_extension.py) ----------------------
    Use("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod", MODULE_ATTR, "both",
        (f"{EXT}:WeightReloadExtension._asyncrl_fix_tied_lm_head",), "the lm_head's method the fix knows"),
    Use("vllm.model_executor.layers.vocab_parallel_embedding",
        "UnquantizedEmbeddingMethod.process_weights_after_loading", CLASS_ATTR, "both",
        (f"{EXT}:WeightReloadExtension._asyncrl_fix_tied_lm_head",),
        "re-packs a tied lm_head when its twin's packed copy cannot be taken"),
    Use("vllm.model_executor.layers.utils", "layer.cpu_linear =", SOURCE_TEXT, "cpu",
        (f"{EXT}:_packed_twin", f"{EXT}:WeightReloadExtension._asyncrl_fix_tied_lm_head"),
        "the CPU dispatch keeps each linear's packed matmul in `cpu_linear`"),
    Use("vllm.model_executor.model_loader.reload", "layerwise", MODULE_ATTR, "both",
        (f"{EXT}:_end_interrupted_reload",),
        "vLLM's layer-by-layer reload, undone after a failure; its logger is NothingToLoad.LOGGER"),
    *(Use(LAYERWISE, a, MODULE_ATTR, "both", (f"{EXT}:_end_interrupted_reload",),
          "the reload's per-layer state, put back after a failed reload")
      for a in ("LAYERWISE_INFO", "LOADING_LAYERS", "get_layer_tensors", "_place_kernel_tensors",
                "_get_original_loader")),
    *(Use(LAYERWISE, f"Module.{a}", ASSIGNED_ATTR, "both", (f"{EXT}:_end_interrupted_reload",),
          "the torchao flag the reload sets aside on the model, which a failed reload must put back")
      for a in ("_do_torchao_reload", "_original_do_torchao_reload")),
    Use(LAYERWISE, "Parameter.weight_loader", ASSIGNED_ATTR, "both", (f"{EXT}:_end_interrupted_reload",),
        "the reload wraps each parameter's loader to buffer what arrives; a failed one gets its own back"),
    Use("vllm.model_executor.models.qwen2", "Module.lm_head", ASSIGNED_ATTR, "both",
        (f"{EXT}:WeightReloadExtension._asyncrl_tied_lm_head",),
        "a causal LM's output layer (Qwen2's, as every model the project serves), tied or not"),
    Use("vllm.model_executor.layers.vocab_parallel_embedding", "Module.quant_method", ASSIGNED_ATTR, "both",
        (f"{EXT}:WeightReloadExtension._asyncrl_tied_lm_head",),
        "the lm_head's method, whose packing a tied one needs"),
    Use("transformers.models.qwen2.configuration_qwen2", "PretrainedConfig.tie_word_embeddings", ASSIGNED_ATTR, "both",
        (f"{EXT}:WeightReloadExtension._asyncrl_tied_lm_head",),
        "transformers' own: whether the text model ties its lm_head (vLLM's hf_text_config is that config)"),
    Use(LAYERWISE, "%s: Failed to load weights", SOURCE_TEXT, "both", (f"{EXT}:NothingToLoad.MESSAGE",),
        "the warning the filter drops for layers with nothing to load"),
    Use(LAYERWISE, "logger = init_logger(__name__)", SOURCE_TEXT, "both", (f"{EXT}:NothingToLoad.LOGGER",),
        "the warning comes from the logger named after the module, which the filter is installed on"),
    *(Use("vllm.model_executor.model_loader.reload.types", f"LayerReloadingInfo.{a}", k, "both",
          (f"{EXT}:_end_interrupted_reload",), "whether a layer still waits for weights, and its own tensors")
      for a, k in (("can_load", CLASS_ATTR), ("reset", CLASS_ATTR), ("kernel_tensors", INSTANCE_ATTR))),
    # --- other callers --------------------------------------------------------------------------
    Use("vllm.tool_parsers", "ToolParserManager", MODULE_ATTR, "both", (f"{PREFLIGHT}:tool_call_parser",),
        "the tool-call parsers vLLM registers"),
    Use("vllm.tool_parsers", "ToolParserManager.list_registered", CLASS_ATTR, "both",
        (f"{PREFLIGHT}:tool_call_parser",), "inference.tool_call_parser must name one"),
    Use("vllm", "LLM", MODULE_ATTR, "both",
        (f"{CHAT_MODEL}:check_vllm", f"{REAL_MODEL}:check", f"{TOOL_MODEL}:check_vllm",
         f"{VLM_MODEL}:check_vllm"),
        "the scripts check a model they made in vLLM",
        ("model", "dtype", "enforce_eager", "seed", "gpu_memory_utilization")),
    Use("vllm.engine.arg_utils", "EngineArgs.max_model_len", INSTANCE_ATTR, "both",
        (f"{CHAT_MODEL}:check_vllm", f"{REAL_MODEL}:check", f"{TOOL_MODEL}:check_vllm",
         f"{VLM_MODEL}:check_vllm"),
        "LLM(max_model_len=...) reaches EngineArgs through LLM's **kwargs"),
    Use("vllm", "LLM.generate", CLASS_ATTR, "both",
        (f"{CHAT_MODEL}:check_vllm", f"{REAL_MODEL}:check", f"{TOOL_MODEL}:check_vllm",
         f"{VLM_MODEL}:check_vllm"), "offline generation",
        ("use_tqdm",)),
    Use("vllm.inputs", "TokensPrompt", MODULE_ATTR, "both",
        (f"{CHAT_MODEL}:check_vllm", f"{REAL_MODEL}:check", f"{TOOL_MODEL}:check_vllm", f"{MULTIMODAL}:image_input"),
        "prompts as token ids (with images: multi_modal_data, for vLLM's renderer to run the model's processor on)",
        ("prompt_token_ids",)),
    Use(OUTPUTS, "CompletionOutput.text", INSTANCE_ATTR, "both", (f"{CHAT_MODEL}:check_vllm", f"{REAL_MODEL}:check"),
        "the text vLLM generated, compared with transformers'"),
    Use("vllm", "__version__", MODULE_ATTR, "both", (f"{GPU_CHECK}:check_environment",), "reported by the GPU check"),
)
