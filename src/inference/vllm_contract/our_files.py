"""Our side of the vLLM contract: the files of ours that touch vLLM (named once, for the
entries' used_in), where they hold vLLM objects (RECEIVERS: tests/inference/test_vllm_contract.py follows
every attribute read off them), and what the test scans for `vllm` imports, VLLM_* variables and
`vllm serve` flags. A file that reads attributes off the engine must have a receiver here (the
test checks that too): function parameters are not followed, so a file the engine is handed to
is seen only once its receivers name it.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.vllm_contract.kinds import MODEL_RUNNER, WORKER

# Attribute names of our own that the worker extension and recorder put on vLLM objects.
OWN_PREFIXES = ("asyncrl_", "_asyncrl_")

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
RELOAD_FAILURE = "src/inference/reload_failure.py"
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
    Receiver(GEN, "Generations.sample", "final.outputs[0]", "vllm.outputs:CompletionOutput"),
    Receiver(GEN, "Generations.tagged", "c.logprobs[j][t]", "vllm.logprobs:Logprob"),
    Receiver(GEN, "Generations.tagged", "d[t]", "vllm.logprobs:Logprob"),
    # Our worker methods' answers, through collective_rpc.
    Receiver(GEN, "Generations.attach_routing", "taken", "builtins:dict"),
    Receiver(GEN, "token_versions", "span", "vllm.outputs:WeightVersionSpan"),
    Receiver(ALL_WORKERS, "", "engine", ASYNC_LLM),
    Receiver(ALL_WORKERS, "every_worker", "core", "vllm.v1.engine.core_client:AsyncMPClient"),
    Receiver(RELOAD, "ServedWeights.pause", "core", "vllm.v1.engine.core_client:AsyncMPClient"),
    Receiver(RELOAD_FAILURE, "ReloadFailures.break_down", "engine", ASYNC_LLM),
    Receiver(MULTIMODAL, "image_input", "engine", ASYNC_LLM),
    Receiver(MULTIMODAL, "image_input", "engine.model_config", "vllm.config.model:ModelConfig"),
    Receiver(MULTIMODAL, "image_input", "engine.model_config.hf_config", "transformers:PretrainedConfig"),
    Receiver(MULTIMODAL, "image_input", "engine.renderer", "vllm.renderers.base:BaseRenderer"),
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
# Where the test looks for `vllm` imports and VLLM_* variables (all but the contract, which names them).
SCANNED = ("src", "scripts")
CONTRACT = "src/inference/vllm_contract/"
